"""Real faults for tests: a file-size limit (writes fail with EFBIG), and a `lowbit run` in a
second process that stops in its evaluation or after a layer, to be interrupted or killed there."""
from __future__ import annotations

import resource
import signal
import subprocess
import sys
from contextlib import contextmanager

# `lowbit run …` where one function (argv[1], dotted) announces itself and waits instead of running:
# the test decides when it is interrupted (SIGINT) or killed (SIGKILL). Everything before it is the real run.
STOPS_IN = """
import importlib, signal, sys, time
from lowbit.app.cli import main

def stopped(*args, **kwargs):
    print("STOPPED", flush=True)
    time.sleep(600)

module, name = sys.argv[1].rsplit(".", 1)
signal.signal(signal.SIGINT, signal.default_int_handler)  # KeyboardInterrupt, as in a terminal
setattr(importlib.import_module(module), name, stopped)
sys.exit(main(sys.argv[2:]))
"""


def limit_file_size(nbytes: int):
    """A subprocess preexec_fn: in the child, no file may grow past nbytes (RLIMIT_FSIZE)."""
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))
    return apply


@contextmanager
def file_size_limit(nbytes: int):
    """In this process: no file may grow past nbytes (RLIMIT_FSIZE) until the block ends."""
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, old_limit[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)


def start_run_stopping_in(function: str, args: list[str], cwd) -> subprocess.Popen:
    """Start `lowbit ARGS` in a second process; returns once it has called `function` (dotted: module
    and name), which waits there. cwd: not the repository root, whose evaluate/ would shadow Hugging Face's."""
    proc = subprocess.Popen([sys.executable, "-c", STOPS_IN, function, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=cwd)
    line = proc.stdout.readline()
    if line.strip() != "STOPPED":
        proc.kill()
        raise AssertionError(f"the run ended before {function}: {proc.communicate()[1][-3000:]}")
    return proc


def start_run_stopping_in_evaluation(args: list[str], cwd) -> subprocess.Popen:
    """Start `lowbit ARGS`; returns once it has reached its evaluation (the checkpoint's perplexity,
    first of its figures)."""
    return start_run_stopping_in("lowbit.evaluate.evaluation.perplexity", args, cwd)


# `lowbit run …` that reaches its results stage (the checkpoint exported and evaluated), announces
# it with RESULTS and then, as the test asks through the environment, waits until a file exists
# (LOWBIT_TEST_GO: the test changes the world meanwhile) and/or can no longer write a file past
# LOWBIT_TEST_FSIZE bytes (RLIMIT_FSIZE, set only now: a real write failure at the results stage).
AT_RESULTS_STAGE = """
import os, resource, signal, sys, time
import lowbit.app.run as run
from lowbit.app.cli import main

write_results = run.write_results

def at_results_stage(*args, **kwargs):
    print("RESULTS", flush=True)
    go = os.environ.get("LOWBIT_TEST_GO")
    while go and not os.path.exists(go):
        time.sleep(0.05)
    limit = os.environ.get("LOWBIT_TEST_FSIZE")
    if limit:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (int(limit), resource.RLIM_INFINITY))
    return write_results(*args, **kwargs)

run.write_results = at_results_stage
sys.exit(main(sys.argv[1:]))
"""


def start_run_at_results_stage(args: list[str], cwd, **env: str) -> subprocess.Popen:
    """Start `lowbit ARGS` in a second process (AT_RESULTS_STAGE, env its LOWBIT_TEST_* settings);
    returns once it has reached its results stage."""
    import os

    proc = subprocess.Popen([sys.executable, "-c", AT_RESULTS_STAGE, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=cwd, env={**os.environ, **env})
    line = proc.stdout.readline()
    if line.strip() != "RESULTS":
        proc.kill()
        raise AssertionError(f"the run ended before its results stage: {proc.communicate()[1][-3000:]}")
    return proc


# a streamed `lowbit run` that announces each layer it saves and waits after step0's layer STOP_AFTER
# (its environment; default 1): the test kills it there for real (SIGKILL), as a crash or an
# out-of-memory kill would
STOPS_AFTER_A_LAYER = """
import os, sys, time
from lowbit.app import resume
from lowbit.app.cli import main

save = resume.StepLayers.save
def announce(self, index, *args):
    save(self, index, *args)
    print(f"SAVED {self.folder.name} {index}", flush=True)
    if (self.folder.name, index) == ("step0", int(os.environ.get("STOP_AFTER", "1"))):
        time.sleep(600)
resume.StepLayers.save = announce
sys.exit(main(sys.argv[1:]))
"""


def kill_run_after_layer(args: list[str], layer: int) -> int:
    """Run `lowbit <args>` in a second process, SIGKILL it once step0 has saved `layer`; its return code."""
    import os

    child = subprocess.Popen([sys.executable, "-c", STOPS_AFTER_A_LAYER, *args], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONUNBUFFERED": "1", "STOP_AFTER": str(layer)})
    try:
        for line in child.stdout:
            if line.startswith(f"SAVED step0 {layer}"):
                break
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait(timeout=60)
    return child.returncode
