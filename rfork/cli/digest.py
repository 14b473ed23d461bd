"""Write a checkpoint's per-rank digests: the anchors an admin uploads with PUT /v1/anchors."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def configure(parser: argparse.ArgumentParser) -> None:
    """Options of `rfork digest`."""
    parser.add_argument(
        "--checkpoint", type=Path, required=True, help="safetensors checkpoint directory or file"
    )
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size the seeds serve (default 1)")
    parser.add_argument(
        "--model", default=None, help="model name in the identity (default: from config.json)"
    )
    parser.add_argument("--revision", default="main", help="model revision in the identity (default main)")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="write the JSON list here (default stdout); one PUT body per rank",
    )


def run(args: argparse.Namespace) -> int:
    """Read every rank from disk, digest it ($RFORK_DIGEST: xxh3-128 or blake3), write the upload bodies.

    The identity is the one `rfork seed` with the same --tp, --model and --revision registers, so the
    seeds' manifests match the uploaded anchor; an operator who uploads these needs no anchor token at all.
    """
    if args.tp < 1:
        raise ValueError("--tp must be >= 1")
    # imported here: `rfork --help` imports every command module, which must stay light (start-up time)
    from rfork.weights.checkpoint import load_rank_from_disk, read_checkpoint_info
    from rfork.weights.rank_weights import RankWeights

    info = read_checkpoint_info(args.checkpoint)
    identity = info.identity(tp=args.tp, revision=args.revision, model=args.model)
    bodies = []
    for rank in range(args.tp):
        layout, buffers, tensors = load_rank_from_disk(info, tp=args.tp, rank=rank)
        weights = RankWeights(rank=rank, layout=layout, buffers=buffers, tensors=tensors)
        sums = weights.compute_checksums()
        bodies.append(
            {
                "identity": identity.model_dump(),
                "rank": rank,
                "checksum_algorithm": weights.checksum_algorithm,
                "tensors": [
                    {
                        "name": p.name,
                        "dtype": p.dtype,
                        "shape": list(p.shape),
                        "nbytes": p.nbytes,
                        "checksum": sums[p.name],
                    }
                    for p in layout.placements
                ],
            }
        )
        del weights, buffers, tensors  # one rank in memory at a time
    text = json.dumps(bodies, indent=1)
    if args.out is None:
        sys.stdout.write(text + "\n")
    else:
        args.out.write_text(text + "\n", encoding="utf-8")
    return 0
