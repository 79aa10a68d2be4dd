"""Regenerate the gRPC stubs next to ``tensorhub.proto``.

Run ``python tensorhub/proto/regenerate.py [OUT_DIR]`` after editing the .proto
(by path, not with -m: importing the tensorhub package first loads the old
stubs into protobuf's descriptor pool, and protoc then crashes). The test suite
fails while the committed stubs are stale. Needs ``grpcio-tools`` (the ``dev``
and ``test`` extras), pinned so that the output is reproducible.
"""

from __future__ import annotations

import sys
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
REPO_ROOT = PROTO_DIR.parent.parent
PROTO = PROTO_DIR / "tensorhub.proto"


def generate(out_dir: Path) -> list[Path]:
    """Run protoc on tensorhub.proto, writing into ``out_dir/tensorhub/proto``.

    Returns the generated files.
    """
    from grpc_tools import protoc  # dev-only dependency

    target = out_dir / "tensorhub" / "proto"
    target.mkdir(parents=True, exist_ok=True)
    rel = PROTO.relative_to(REPO_ROOT)
    args = [
        "protoc",
        f"-I{REPO_ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(rel),
    ]
    code = protoc.main(args)
    if code != 0:
        raise RuntimeError(f"protoc failed with exit code {code}: {' '.join(args)}")
    return sorted(p for p in target.iterdir() if p.name.startswith("tensorhub_pb2"))


def main(argv: list[str]) -> int:
    out = Path(argv[0]).resolve() if argv else REPO_ROOT
    for path in generate(out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
