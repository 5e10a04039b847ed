"""compressed-tensors: the format (format.py) and its codecs, one per scheme family (int8.py,
packed.py, fp8.py), dispatched by codecs.py."""
from .codecs import (CODECS, QUANT_METHOD, build_module, check_consumers_can_load,  # noqa: F401
                     is_quantized, module_tensors, quantization_config, quantized_prefixes)
from .format import CompressedTensorsFormat  # noqa: F401
