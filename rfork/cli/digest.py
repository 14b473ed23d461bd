"""Write a checkpoint's per-rank digests: the anchors an admin uploads (`rfork anchor upload` does both)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

from rfork.cli.logs import progress_bar
from rfork.cli.options import add_model_name

log = logging.getLogger("rfork.digest")


def add_checkpoint_options(parser: argparse.ArgumentParser) -> None:
    """--checkpoint, --tp, --model-name, --revision: the identity `rfork seed` with the same options
    registers, so that its manifests match what is anchored."""
    parser.add_argument(
        "--checkpoint", type=Path, required=True, help="safetensors checkpoint directory or .safetensors file"
    )
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size the seeds serve")
    add_model_name(parser)
    parser.add_argument("--revision", default="main", help="model revision in the identity")


def configure(parser: argparse.ArgumentParser) -> None:
    """Options of `rfork digest`."""
    add_checkpoint_options(parser)
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="write the JSON list here (default: stdout); one PUT /v1/anchors body per rank",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def anchor_bodies(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Read every rank from disk and digest it ($RFORK_DIGEST: xxh3-128 or blake3): one PUT /v1/anchors
    body per rank, a progress bar over the ranks' bytes while it runs."""
    if args.tp < 1:
        raise ValueError("--tp must be >= 1")
    # imported here: `rfork --help` imports every command module, which must stay light (start-up time)
    from rfork.weights.checkpoint import load_rank_from_disk, read_checkpoint_info
    from rfork.weights.rank_weights import RankWeights
    from rfork.weights.stripes import publishes_stripes

    info = read_checkpoint_info(args.checkpoint)
    identity = info.identity(tp=args.tp, revision=args.revision, model=args.model_name)
    bodies = []
    done = 0
    with progress_bar(
        "digesting", total=info.total_bytes, enabled=not getattr(args, "no_progress", False)
    ) as bar:
        for rank in range(args.tp):
            bar(done, description=f"reading rank {rank}")
            t0 = time.perf_counter()
            layout, buffers, tensors = load_rank_from_disk(info, tp=args.tp, rank=rank)
            weights = RankWeights(rank=rank, layout=layout, buffers=buffers, tensors=tensors)
            bar(done + layout.total_bytes // 2, description=f"digesting rank {rank}")
            sums = weights.compute_checksums()
            stripes = weights.compute_stripes() if publishes_stripes(identity) else {}  # as its seeds do
            done += layout.total_bytes
            bar(done)
            log.info(
                "rank %d: %d tensors, %d bytes read and digested (%s) in %.2f s",
                rank,
                len(layout.placements),
                layout.total_bytes,
                weights.checksum_algorithm,
                time.perf_counter() - t0,
            )
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
                            **({"stripes": stripes[p.name].model_dump()} if p.name in stripes else {}),
                        }
                        for p in layout.placements
                    ],
                }
            )
            del weights, buffers, tensors  # one rank in memory at a time
    return bodies


def run(args: argparse.Namespace) -> int:
    """Digest every rank and write the upload bodies.

    The identity is the one `rfork seed` with the same --tp, --model-name and --revision registers, so
    the seeds' manifests match the uploaded anchor; an operator who uploads these needs no anchor token.
    """
    text = json.dumps(anchor_bodies(args), indent=1)
    if args.out is None:
        sys.stdout.write(text + "\n")
    else:
        args.out.write_text(text + "\n", encoding="utf-8")
    return 0
