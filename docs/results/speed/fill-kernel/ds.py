"""decode_speed with the fill step's kernel on (FILL_KERNEL=1) or off (0: MLX's attention)."""
import os
import sys

sys.path.insert(0, "benchmarks")
import decode_speed  # noqa: E402
from velox.registry import get_method  # noqa: E402

if os.environ.get("FILL_KERNEL", "1") == "0":
    for key in ("tova", "streaming_llm", "knorm"):
        get_method(key).backends["cuda"].fill_attention = lambda *a: None
sys.exit(decode_speed.main(sys.argv[1:]))
