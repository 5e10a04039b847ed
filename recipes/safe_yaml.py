"""YAML for recipes and --set values: safe_load (a !!python tag is an error, never code), with the
document's size bounded before anything is built from it.

Aliases make a small text a large value: a 1.3 KB "billion laughs" (each anchor a list of ten
aliases to the one before) stands for 10^9 strings. Loading shares the objects, so the load is
cheap, but anything that walks the value expanded (validation, an error quoting it, the resolved
recipe written out) does not finish. So the composed node graph is measured first, with every
alias counted as a copy of its anchor's value (memoised per node: linear in the graph), and a
document whose aliases take it past MAX_VALUES values or MAX_CHARACTERS characters, or nest it
deeper than MAX_DEPTH, or that refers to itself, is refused. A file without aliases is never
refused for its size: its text is already that large.
"""
from __future__ import annotations

import yaml
from yaml.constructor import ConstructorError

from lowbit.calibrate.messages import decimal_digits

# a per-linear plan of a 400B model (lowbit fit --write) has ~1,000 entries, a few values each
MAX_VALUES = 200_000
MAX_CHARACTERS = 20_000_000  # scalar text, counted per alias-expanded copy
MAX_DEPTH = 64  # real recipes nest 4-6 levels; walking deeper ones risks Python's recursion limit
MAX_INT_DIGITS = 4000  # below Python's 4300-digit limit on printing an integer


class DocumentTooLarge(ValueError):
    """The document is refused before it is built; the message says why in one line."""


def load(text: str):
    """yaml.safe_load(text) for a document within the bounds above."""
    return yaml.load(text, Loader=BoundedLoader)  # noqa: S506  (a SafeLoader: no !!python tags)


def one_line(err: yaml.YAMLError) -> str:
    """A YAML error as one line: the problem and where (PyYAML's own text quotes the line with a
    caret underneath, over several lines)."""
    if not isinstance(err, yaml.MarkedYAMLError) or err.problem is None:
        return _clip(" ".join(str(err).split()))
    where = f" at line {err.problem_mark.line + 1}, column {err.problem_mark.column + 1}" if err.problem_mark else ""
    context = f" ({' '.join(err.context.split())})" if err.context else ""
    return _clip(" ".join(err.problem.split())) + where + context


def _clip(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "…"


class BoundedLoader(yaml.SafeLoader):
    depth = 0  # of the node being composed

    def fetch_flow_collection_start(self, TokenClass):
        # the scanner looks ahead over nested [ and { in quadratic time: stop at the bound
        if self.flow_level >= MAX_DEPTH:
            raise DocumentTooLarge(f"values nested more than {MAX_DEPTH} levels deep (line {self.line + 1})")
        super().fetch_flow_collection_start(TokenClass)

    def compose_node(self, parent, index):
        # the composer recurses per level: stop at the bound, not at Python's recursion limit
        if self.depth >= MAX_DEPTH:
            raise DocumentTooLarge(f"values nested more than {MAX_DEPTH} levels deep (line {self.line + 1})")
        self.depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def get_single_node(self):
        node = super().get_single_node()
        if node is not None:
            check_expansion(node)
        return node

    def construct_yaml_int(self, node):
        # checked before int() (which refuses 4300 decimal digits) and after (hex and base-60
        # literals give more digits than they are written with)
        digits = sum(c.isalnum() for c in self.construct_scalar(node))  # `!!int [a]`: a ConstructorError
        value = None if digits > MAX_INT_DIGITS else super().construct_yaml_int(node)
        if value is not None and value.bit_length() > MAX_INT_DIGITS * 3.3:  # bits per decimal digit
            digits = decimal_digits(value)
        if digits > MAX_INT_DIGITS:
            raise ConstructorError(None, None, f"an integer of {digits} digits (at most {MAX_INT_DIGITS})",
                                   node.start_mark)
        return value

    def construct_object(self, node, deep=False):
        try:
            return super().construct_object(node, deep)
        except (ValueError, LookupError, TypeError, ArithmeticError, AttributeError) as err:
            # a value its tag (implicit or written, as in `!!bool maybe`) cannot read: 2024-02-30,
            # `!!int abc`, `!!int ""`, `!!timestamp ""`: PyYAML's constructors let int(), datetime(),
            # an index, a lookup in their tables or a failed regex match raise
            tag = node.tag.replace("tag:yaml.org,2002:", "!!")
            what = f" {node.value[:40]!r}" if isinstance(node, yaml.ScalarNode) else ""
            raise ConstructorError(None, None, f"{tag} cannot read{what} ({type(err).__name__}: {err})",
                                   node.start_mark) from None


BoundedLoader.add_constructor("tag:yaml.org,2002:int", BoundedLoader.construct_yaml_int)


def check_expansion(root: yaml.Node) -> None:
    """Refuse a node graph whose alias-expanded size or depth is past the bounds, or that refers to
    itself (an alias inside its own anchor's value)."""
    (values, characters, depth), distinct_values, distinct_characters = expanded_size(root)
    if values > MAX_VALUES and values > distinct_values:
        raise DocumentTooLarge(f"aliases expand it to {values} values (at most {MAX_VALUES}); write the "
                               "values out, or use fewer aliases")
    if characters > MAX_CHARACTERS and characters > distinct_characters:
        raise DocumentTooLarge(f"aliases expand it to {characters} characters of text (at most "
                               f"{MAX_CHARACTERS}); write the values out, or use fewer aliases")
    if depth > MAX_DEPTH:
        raise DocumentTooLarge(f"values nested {depth} levels deep (at most {MAX_DEPTH})")


def expanded_size(root: yaml.Node) -> tuple[tuple[int, int, int], int, int]:
    """(values, scalar characters, depth) of the document with every alias expanded, and the
    values and characters of the nodes as written. Iterative depth-first walk (a deep document
    must not hit the recursion limit here), each node measured once from its children's measures."""
    done: dict[int, tuple[int, int, int]] = {}
    on_path: set[int] = set()
    written_characters = 0
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_measured = stack.pop()
        if children_measured:
            kids = [done[id(child)] for child in _children(node)]
            own = len(node.value) if isinstance(node, yaml.ScalarNode) else 0
            written_characters += own
            done[id(node)] = (1 + sum(k[0] for k in kids), own + sum(k[1] for k in kids),
                              1 + max((k[2] for k in kids), default=0))
            on_path.discard(id(node))
        elif id(node) in on_path:
            raise DocumentTooLarge(f"the value at line {node.start_mark.line + 1}, column {node.start_mark.column + 1} "
                                   "contains an alias to itself (a value cannot include itself)")
        elif id(node) not in done:
            on_path.add(id(node))
            stack.append((node, True))
            stack.extend((child, False) for child in _children(node))
    return done[id(root)], len(done), written_characters


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []
