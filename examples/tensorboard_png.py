"""Draw the scalars of a TensorBoard log dir into one PNG, headless (no browser, no TensorBoard server).

    python examples/train.py --local --tensorboard runs/train
    python examples/tensorboard_png.py runs/train tensorboard.png

Reads the event files with TensorBoard's own reader and draws one panel per tag (as
TensorBoard's Scalars tab lays them out), with matplotlib's Agg backend. docs/dataset.md shows
the picture a test run made this way.
"""

from __future__ import annotations

import argparse
import sys

#: The tags drawn by default (cachefs.client.stats.tensorboard writes them), in this order.
DEFAULT_TAGS = ("cachefs/step/wait_share", "cachefs/step/recent_wait_share", "cachefs/data/samples",
                "cachefs/data/wait_s", "cachefs/data/held_bytes", "cachefs/data/hits", "cachefs/data/misses",
                "cachefs/data/hit_ratio", "cachefs/data/hints_answered")


def load(logdir: str) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag of the log dir: tag -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(logdir, size_guidance={"scalars": 0})  # 0: keep every point
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def render(logdir: str, out: str, tags: tuple[str, ...] | None = None, columns: int = 3,
           title: str | None = None) -> list[str]:
    """Write the PNG; returns the tags drawn (those of ``tags`` present in the log dir)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scalars = load(logdir)
    drawn = [t for t in (tags or DEFAULT_TAGS) if t in scalars] or sorted(scalars)
    if not drawn:
        raise ValueError(f"no scalars in {logdir}")
    rows = -(-len(drawn) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 2.8 * rows), squeeze=False)
    for ax in axes.flat[len(drawn):]:
        ax.axis("off")
    for ax, tag in zip(axes.flat, drawn):
        steps, values = zip(*scalars[tag])
        ax.plot(steps, values, color="#ff7043", linewidth=1.6, marker="o", markersize=2.5)
        ax.set_title(tag, fontsize=9, loc="left")
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(True, color="#e0e0e0", linewidth=0.6)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    fig.suptitle(title or f"TensorBoard scalars: {logdir}", fontsize=9, x=0.01, ha="left")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return drawn


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("logdir")
    p.add_argument("out", help="the PNG to write")
    p.add_argument("--tags", help="comma-separated tags (default: the cachefs ones that are there)")
    p.add_argument("--title", help="the picture's title (default: the log dir)")
    args = p.parse_args(argv)
    drawn = render(args.logdir, args.out, tuple(args.tags.split(",")) if args.tags else None, title=args.title)
    print(f"wrote {args.out}: {', '.join(drawn)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
