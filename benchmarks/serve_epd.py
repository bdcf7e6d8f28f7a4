"""Workloads (e) and (f) of `make bench-serve` (benchmarks/serve.py).

(e) E/PD on one host: an encoder instance (`ec_producer`; vLLM 0.32 runs
    it encoder-only) on core 0 and a prefill/decode instance
    (`ec_consumer`) on core 1 behind the E/PD proxy (benchmarks/epd_proxy.py,
    the full request resent to PD). Modes: "ec-daemon" (both instances on
    one daemon), "example" (vLLM's ECExampleConnector on a shared temporary
    folder) and "none": one engine without a connector, on core 0, the
    same requests sent to it directly. Each mode starts its own engines. Per
    mode: TTFT as the client sees it (through the proxy: the encoder
    instance's step included) and the PD engine's encoder forwards (the
    single engine's, for "none").

(f) The reuse sweep, on the two engines of workloads (a)-(d) (round-robin,
    each mode's own pair): at 20%, 50% and 80% reuse, a stream of new and
    seen images (phase 0), then images that arrive at both engines at once
    (phase 1: each new image sent to both engines at the same instant).
    Per mode and level: TTFT; the cross-engine hit rate of phase 0, the
    share of first showings of an image on one engine, after another
    engine showed it, that cost no encode (from the encoder forwards:
    (engine-image pairs - forwards) / (engine-image pairs - images));
    and of phase 1 the encodes avoided: the share of the second engine's
    encodes that did not happen ((2 x images - forwards) / images).
    Both assume an engine does not encode an image twice (vLLM's encoder
    and prefix caches hold every image of these short streams).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.epd_proxy import EPDProxy
from benchmarks.serve_hosts import Daemon, Engine, EngineSetup, start_engines
from benchmarks.serve_modes import ModeRun, ec_config, totals
from benchmarks.serve_report import summarise
from benchmarks.serve_stream import (
    ONE,
    ROUND_ROBIN,
    Client,
    Outcome,
    Request,
    make_images,
    make_stream,
)

REUSE_LEVELS = (0.2, 0.5, 0.8)


class EPDRun:
    """Context manager: a mode's engines of workload (e) (and its daemon and
    proxy), each warmed up with a request of its own image; all stopped by
    pid on exit, the daemon's region freed."""

    def __init__(self, mode: str, setup: EngineSetup, client: Client, folder: Path,
                 image_size: int) -> None:
        folder.mkdir(parents=True)
        self.mode = mode
        self.client = client
        self.setup = setup
        self.daemon = Daemon(folder / "host") if mode == "ec-daemon" else None
        socket = self.daemon.uri if self.daemon else ""
        self.proxy: EPDProxy | None = None
        if mode == "none":
            self.engines = [Engine(0, setup, [], {}, folder / "engine.log")]
        else:
            self.engines = [
                Engine(i, setup, ec_config(mode, setup.device, socket, folder / "ec-shared", role),
                       {}, folder / f"{name}.log")
                for i, (name, role) in enumerate((("encoder", "ec_producer"),
                                                  ("pd", "ec_consumer")))]
        self.warm_image = make_images(folder, 1, image_size, 20_000, "warm-up")[0]

    @property
    def pd(self) -> Engine:
        return self.engines[-1]

    @property
    def url(self) -> str:
        return self.proxy.url if self.proxy else self.pd.url

    def __enter__(self) -> EPDRun:
        try:
            if self.daemon:
                self.daemon.start(fresh=True)
            start_engines(self.engines, self.setup)
            if len(self.engines) == 2:
                self.proxy = EPDProxy(self.engines[0].url, self.pd.url).start()
            warm = self.client.send([Request(0, self.warm_image, 0, 0, 0.0, "cold")], [self.url])
            if not warm[0].ok:
                raise RuntimeError(f"{self.mode}: the warm-up failed: {warm[0].error[-2000:]}")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.proxy:
            self.proxy.stop()
        for engine in self.engines:
            engine.stop()
        if self.daemon:
            self.daemon.stop()
            self.daemon.clean()

    def snapshot(self) -> dict[tuple[str, str], float]:
        out = {("pd", "pd_encoder_forwards"): float(self.pd.encoder_forwards())}
        if len(self.engines) == 2:
            out[("e", "encoder_instance_forwards")] = float(self.engines[0].encoder_forwards())
        if self.proxy:
            out[("proxy", "proxy_encoder_failed")] = float(self.proxy.stats.encoder_failed)
        if self.daemon:
            stats = self.daemon.stats()
            for name in ("hits", "misses", "saves", "loads"):
                out[("daemon", f"daemon_{name}")] = float(stats[name])
        return out

    def run(self, stream: list[Request]) -> dict[str, Any]:
        """Send `stream`; the mode's row of (e)."""
        before = self.snapshot()
        outcomes = self.client.send(stream, [self.url])
        counters = totals(before, self.snapshot())
        forwards = counters["pd_encoder_forwards"] + counters.get("encoder_instance_forwards", 0)
        row = summarise(self.mode, outcomes, {**counters, "encoder_forwards": forwards})
        row["topology"] = "one engine" if self.mode == "none" else "E/PD"
        row["pd_encodes_avoided"] = 1 - counters["pd_encoder_forwards"] / len(stream)
        return row


def e_stream(folder: Path, count: int, images: int, rate: float, reuse: float, seed: int,
             image_size: int) -> list[Request]:
    paths = make_images(folder, images, image_size, seed, "e")
    return make_stream(paths, count, rate, reuse, seed, ONE)


def sweep_streams(folder: Path, level: float, count: int, images: int, at_once: int,
                  rate: float, seed: int, image_size: int) -> list[Request]:
    """Phase 0: `count` requests round-robin at `level` reuse; phase 1:
    `at_once` new images, each sent to both engines at the same instant."""
    tag = f"f{round(level * 100)}"
    paths = make_images(folder, images + at_once, image_size, seed, tag)
    stream = make_stream(paths[:images], count, rate, level, seed, ROUND_ROBIN)
    for j, image in enumerate(paths[images:]):
        stream += [Request(count + 2 * j + e, image, e, 1, 2 * j / rate, "cold") for e in (0, 1)]
    return stream


def sweep_row(mode: str, run: ModeRun, stream: list[Request]) -> dict[str, Any]:
    """One mode's row of one reuse level of (f)."""
    first = [r for r in stream if r.phase == 0]
    twins = [r for r in stream if r.phase == 1]
    (out0, counters0), (out1, counters1) = run.phases(first, twins)
    outcomes: list[Outcome] = out0 + out1
    counters = {k: counters0.get(k, 0) + counters1.get(k, 0)
                for k in set(counters0) | set(counters1)}
    row = summarise(mode, outcomes, counters)
    images = len({r.image for r in first})
    firsts = len({(r.engine, r.image) for r in first})
    forwards0, forwards1 = counters0["encoder_forwards"], counters1["encoder_forwards"]
    pairs = len(twins) // 2
    row.update(stream_forwards=forwards0, engine_image_pairs=firsts, stream_images=images,
               at_once_images=pairs, at_once_forwards=forwards1,
               cross_engine_hit_rate=_share(firsts - forwards0, firsts - images),
               at_once_encodes_avoided=_share(2 * pairs - forwards1, pairs))
    done = [o.ttft_ms for o in out1 if o.ok]
    if done:
        row["at_once_ttft_mean_ms"] = sum(done) / len(done)
    return row


def _share(part: float, whole: float) -> float | None:
    return min(1.0, max(0.0, part / whole)) if whole > 0 else None


def figure(results: dict[str, Any], folder: Path) -> Path | None:
    """(e): TTFT by mode (mean, cold, repeat) with the PD engine's encoder
    forwards; (f): TTFT, cross-engine hit rate and encodes avoided at once
    by reuse level. One PNG in `folder`, or None without (e) or (f)."""
    e = [w for w in results["workloads"] if w["key"] == "e"]
    f = sorted((w for w in results["workloads"] if w["workload"] == "f"),
               key=lambda w: w["reuse"])
    if not e and not f:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
    if e:
        rows = e[0]["modes"]
        width = 0.25
        for k, field in enumerate(("ttft_mean_ms", "cold_ttft_mean_ms", "repeat_ttft_mean_ms")):
            axes[0].bar([i + k * width for i in range(len(rows))],
                        [r.get(field) or 0 for r in rows], width, label=field[:-8])
        axes[0].set_xticks([i + width for i in range(len(rows))],
                           [f"{r['mode']}\n({r['topology']}, PD fwd {r['pd_encoder_forwards']})"
                            for r in rows], fontsize=8)
        axes[0].set(title=f"(e) E/PD, {e[0]['requests']} requests", ylabel="TTFT (ms)")
        axes[0].legend(fontsize=8)
    modes = sorted({r["mode"] for w in f for r in w["modes"]})
    width = 0.8 / (2 * max(1, len(modes)))
    for m, mode in enumerate(modes):
        points = [(i, w["reuse"] * 100, next(r for r in w["modes"] if r["mode"] == mode))
                  for i, w in enumerate(f) if any(r["mode"] == mode for r in w["modes"])]
        line = axes[1].plot([p for _, p, _ in points], [r["ttft_mean_ms"] for *_, r in points],
                            marker="o", label=mode)[0]
        for k, (field, hatch) in enumerate((("cross_engine_hit_rate", ""),
                                            ("at_once_encodes_avoided", "//"))):
            axes[2].bar([i - 0.4 + (2 * m + k + 0.5) * width for i, *_ in points],
                        [r[field] or 0 for *_, r in points], width, color=line.get_color(),
                        hatch=hatch, edgecolor="black", linewidth=0.5,
                        label=f"{mode}: {'cross-engine hit rate' if k == 0 else 'avoided at once'}")
    axes[1].set(title="(f) TTFT by reuse (two engines)", xlabel="reuse (%)",
                ylabel="mean TTFT (ms)")
    axes[2].set_xticks(range(len(f)), [f"{w['reuse']:.0%}" for w in f])
    axes[2].set(title="(f) encodes served by another engine", xlabel="reuse",
                ylabel="share", ylim=(0, 1.3))
    for ax in axes[1:]:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2 if ax is axes[2] else 1)
    fig.suptitle(f"bench-serve {results.get('command', '')} (seed {results['seed']})",
                 fontsize=9)
    fig.tight_layout()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "serve-epd-reuse.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
