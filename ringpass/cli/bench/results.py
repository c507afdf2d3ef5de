"""What ``ringpass bench`` reports: per-case rows from every rank's measurements, the table, JSON and plot.

A row (`summarise`) is one (method, world size P, sequence length N):

- ``forward_s`` / ``total_s``: median, min and max over the repeats of the slowest rank's seconds
  (forward; forward+backward, or the whole training step for a model); ``total_s["each"]``: every repeat's, in
  the order measured (with ``--interleave`` repeat i of every method ran in turn i: ratios turn by turn cancel
  what the machine drifted between turns).
- ``forward_mib`` / ``total_mib``: per-rank peak memory above what the rank held before the call
  (the largest rank, median over repeats; `measure.PeakMemory`). ``need_mib``: what the ring algorithm
  itself must hold (`lowering.costmodel.RingCost.working_memory`). ``first_call_mib``: the first
  (warm-up) call's peak, which also pays for one-time set-up (compiles included, for a model).
- ``efficiency``: parallel efficiency ``T_single / (W · T)``, with ``T_single`` the one-thread
  single-process baseline's time at the same N and W the cores the method used (ranks x threads per rank).
  ``vs_same_cores``: ``T_same / T``, with ``T_same`` the single-process baseline given the same number of
  threads (above 1: faster than one process on the same cores).
- ``hidden``: the fraction of communication time hidden behind compute, ``1 - exposed / communication``
  (mean over ranks and repeats): ``communication`` is what the rank's hideable messages take alone
  (measured without compute: P-1 KV hops forward, P-1 KV and P-1 dK/dV hops backward; the last dK/dV
  accumulator's trip home follows the last compute and cannot hide, the cost model adds it to the
  backward's time); ``exposed`` is its time
  blocked in the ring's waits (span events) less, for each wait, the part before the sending neighbour
  had posted that message (waiting for a slower rank is imbalance, not transfer: ``balance`` shows it).
  The all-gather's collectives are never hidden (0). Not given on CUDA, where the spans time launches.
- ``balance``: max / mean over ranks of the seconds spent computing blocks (1 = perfectly balanced);
  ``pairs_balance``: the same of the (query, key) pairs the forward's kernels scored (counted, not timed);
  ``pairs_scored``: those pairs summed over the ranks and the batch's rows (the work the method does).
  ``sent_mib``: a ring row's MiB one rank sends per call (K/V and dK/dV; the rank that sends most): less than the
  whole lap's where blocks stop at the last rank that needs them; ``unsent_mib``: the most a rank did not send of
  the whole lap (blocks no later rank needed). ``pairs_skipped``: with ``--packed``, the (query, key) pairs of the
  causal plan that no query of the same document sees, left out of every rank's forward (summed; the backward skips
  them too).
- ``predicted``: `lowering.costmodel` on the bench's `Hardware`: forward and forward+backward seconds,
  whether the transfer hides.
- ``error``: max |out - ref| / max |ref| against fp32 SDPA on the whole sequence (attention); for a model,
  ``loss_error``: |loss - unsharded loss| / |unsharded loss|, ``exchanges`` (the ring ran: > 0) and
  ``ring_s`` (the slowest rank's seconds inside the ring's steps: attention's share of the step).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict

from lowering.costmodel import (
    DecodeCost,
    Hardware,
    all_gather_seconds,
    decode_seconds,
    predict,
    ring_cost,
)
from lowering.errors import InvalidInputError
from lowering.layout import Layout
from ringpass.cli.bench.attention import attention_shape, layout_kind

MIB = 2**20
SINGLE_PROCESS = {"attention": "sdpa", "model": "unsharded", "decode": "sdpa", "generate": "unsharded"}  # baselines


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _slowest(record: dict, key: str) -> list[float]:
    """Per repeat, the slowest rank's ``key``."""
    ranks = [r["samples"] for r in record["ranks"]]
    return [max(samples[i][key] for samples in ranks) for i in range(len(ranks[0]))]


def _peak_mib(record: dict, key: str):
    values = [s[key] for r in record["ranks"] for s in r["samples"]]
    if any(v is None for v in values):
        return None
    per_repeat = [max(r["samples"][i][key] for r in record["ranks"]) for i in range(len(record["ranks"][0]["samples"]))]
    return statistics.median(per_repeat) / MIB


def _attention_extras(row: dict, record: dict, config, hardware: Hardware) -> None:
    p, n, method = record["world_size"], record["seq_len"], record["method"]
    row["error"] = max(s["error"] for r in record["ranks"] for s in r["samples"])
    if p == 1:
        return
    pairs = [statistics.median(s["pairs"] for s in r["samples"]) for r in record["ranks"]]
    row["pairs_balance"] = max(pairs) / statistics.mean(pairs) if statistics.mean(pairs) > 0 else None
    row["pairs_scored"] = sum(pairs)
    if method.startswith("ring"):
        for key, name in (("sent_bytes", "sent_mib"), ("unsent_bytes", "unsent_mib")):
            row[name] = max(statistics.median(s[key] for s in r["samples"]) for r in record["ranks"]) / MIB
        if config.packed:
            skipped = [statistics.median(s["skipped_pairs"] for s in r["samples"]) for r in record["ranks"]]
            row["pairs_skipped"] = sum(skipped)
    if not config.packed:  # the cost model prices one causal triangle, not documents: no prediction for a packed row
        _predictions(row, method, Layout(layout_kind(method, config.causal), p, n), config, hardware)
    compute = [statistics.median(s["compute_s"] for s in r["samples"]) for r in record["ranks"]]
    row["balance"] = max(compute) / statistics.mean(compute) if statistics.mean(compute) > 0 else None
    if record["device"] == "cuda":
        row["hidden"] = None
    elif method == "all-gather":
        row["hidden"] = 0.0
    elif method.startswith("ring") and record["messages"]:
        m = record["messages"]
        communication = (p - 1) * (2 * m["kv"] + m["dkv"])  # the hideable messages, each alone
        exposed = statistics.mean(
            _exposed_seconds(record, rank, i) for rank in range(p) for i in range(len(record["ranks"][0]["samples"]))
        )
        row["hidden"] = min(1.0, max(0.0, 1.0 - exposed / communication)) if communication > 0 else None


def _predictions(row: dict, method: str, layout: Layout, config, hardware: Hardware) -> None:
    """The cost model's time (and the ring's working memory) for a ring or all-gather row."""
    cost = ring_cost(layout, attention_shape(config))
    if method.startswith("ring"):
        prediction = predict(cost, hardware)
        row["predicted"] = {
            "forward_s": prediction.forward_s,
            "total_s": prediction.forward_s + prediction.backward_s,
            "hides": prediction.hides,
        }
        row["need_mib"] = {k: v / MIB for k, v in cost.working_memory().items()}
    elif method == "all-gather":
        row["predicted"] = {
            "forward_s": all_gather_seconds(cost, hardware),
            "total_s": all_gather_seconds(cost, hardware) + all_gather_seconds(cost, hardware, backward=True),
            "hides": False,
        }


def _exposed_seconds(record: dict, rank: int, repeat: int) -> float:
    """Seconds rank ``rank`` waited for transfers still in flight in one call: each wait, less the part of it
    before its sender (the previous rank) had even posted the message (a late neighbour, not the link)."""
    p = record["world_size"]
    mine, sender = record["ranks"][rank]["samples"][repeat], record["ranks"][(rank - 1) % p]["samples"][repeat]
    exposed = 0.0
    for message, start, seconds in mine["waits"]:
        if message == "backward dkv home" or message.endswith(" sent"):
            continue  # a dK/dV accumulator's trip home (nothing is left to hide it behind); this rank's sends leaving
        late = max(0.0, sender["posts"][message] - start)
        exposed += max(0.0, seconds - late)
    return exposed


def _decode_extras(row: dict, record: dict, config, hardware: Hardware) -> None:
    """A decode step's error, the cache one rank holds, the merges it made and the cost model's time."""
    samples = [s for r in record["ranks"] for s in r["samples"]]
    row["error"] = max(s["error"] for s in samples)
    row["cache_mib"] = max(r["cache_bytes"] for r in record["ranks"]) / MIB
    row["merges"] = min(s["merges"] for s in samples)
    row["kv_exchanges"] = max(s["kv_exchanges"] for s in samples)
    ranks = record["world_size"] if record["method"] == "sharded" else 1
    cost = DecodeCost(attention_shape(config), record["seq_len"], ranks, config.new_tokens)
    predicted = decode_seconds(cost, hardware)
    row["predicted"] = {
        "forward_s": predicted["total"],
        "total_s": predicted["total"],
        "hides": False,
        "compute_s": predicted["compute"],
        "merge_s": predicted["merge"],
    }


def _generate_extras(row: dict, record: dict) -> None:
    """A generation's cache per rank, its merges and gathers, and its tokens (compared in `_relative`)."""
    row["cache_mib"] = max(r["cache_bytes"] for r in record["ranks"]) / MIB
    row["merges"] = min(r["merges"] for r in record["ranks"])
    row["cache_gathers"] = max(r["cache_gathers"] for r in record["ranks"])
    row["tokens"] = record["ranks"][0]["tokens"]
    row["same_on_every_rank"] = all(r["tokens"] == row["tokens"] for r in record["ranks"])


def _model_extras(row: dict, record: dict, config) -> None:
    row["tokens_per_s"] = config.batch * record["seq_len"] / row["total_s"]["median"]
    row["loss"] = statistics.median(s["loss"] for r in record["ranks"] for s in r["samples"])
    row["exchanges"] = min(s["exchanges"] for r in record["ranks"] for s in r["samples"])
    row["ring_s"] = statistics.median(
        max(r["samples"][i]["ring_s"] for r in record["ranks"]) for i in range(len(record["ranks"][0]["samples"]))
    )
    if record["world_size"] > 1 and record["method"].startswith("ring"):  # packed rows: the ranks' share of the work
        for key, name in (("compute_s", "balance"), ("pairs", "pairs_balance")):
            per_rank = [statistics.median(s[key] for s in r["samples"]) for r in record["ranks"]]
            row[name] = max(per_rank) / statistics.mean(per_rank) if statistics.mean(per_rank) > 0 else None


def summarise(records: list[dict], config, hardware: Hardware) -> dict:
    rows = []
    for record in records:
        row = {k: record[k] for k in ("method", "world_size", "seq_len", "threads", "device")}
        unavailable = [r["unavailable"] for r in record["ranks"] if "unavailable" in r]
        if unavailable:
            rows.append({**row, "unavailable": unavailable[0]})
            continue
        totals = _slowest(record, "total_s")
        row["forward_s"], row["total_s"] = _spread(_slowest(record, "forward_s")), {**_spread(totals), "each": totals}
        row["forward_mib"], row["total_mib"] = _peak_mib(record, "forward_bytes"), _peak_mib(record, "total_bytes")
        row["memory_note"] = record["ranks"][0].get("memory_note")
        first = [r.get("first_call_bytes") for r in record["ranks"]]
        row["first_call_mib"] = max(first) / MIB if first and None not in first else None
        if config.what == "attention":
            _attention_extras(row, record, config, hardware)
            row["chosen"] = record["ranks"][0].get("chosen")  # the auto method's pick
        elif config.what == "decode":
            _decode_extras(row, record, config, hardware)
        elif config.what == "generate":
            _generate_extras(row, record)
        else:
            _model_extras(row, record, config)
        rows.append(row)
    _relative(rows, config)
    return {"config": _config_dict(config), "hardware": asdict(hardware), "rows": rows}


def _relative(rows: list[dict], config) -> None:
    """Efficiency against the single-process baselines, and a model's loss against the unsharded one's."""
    single = SINGLE_PROCESS[config.what]
    baselines = {(r["seq_len"], r["threads"]): r for r in rows if r["method"] == single and "total_s" in r}
    for row in rows:
        if "total_s" not in row:
            continue
        cores = row["world_size"] * row["threads"]
        one = baselines.get((row["seq_len"], 1))
        same = baselines.get((row["seq_len"], cores))
        t = row["total_s"]["median"]
        row["efficiency"] = one["total_s"]["median"] / (cores * t) if one else None
        row["vs_same_cores"] = same["total_s"]["median"] / t if same and row["world_size"] > 1 else None
        if one and config.what == "generate":
            row["same_tokens"] = row["tokens"] == one["tokens"]
        if one and config.what == "model":
            row["loss_error"] = abs(row["loss"] - one["loss"]) / abs(one["loss"])
            if one["total_mib"] and row["total_mib"] is not None:  # (tiny runs measure 0 MiB)
                row["memory_vs_unsharded"] = row["total_mib"] / one["total_mib"]


def _config_dict(config) -> dict:
    data = asdict(config)
    data["model"] = asdict(config.model)
    return data


# ---- output ---------------------------------------------------------------------------------------------------
def _fmt(value, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def format_table(summary: dict) -> str:
    c, h = summary["config"], summary["hardware"]
    if c["what"] in ("decode", "generate"):
        return _decode_table(summary)
    model = c["what"] == "model"
    if model:
        m = c["model"]
        described = c["hf_config"] or (
            f"Llama-style hidden {m['hidden']}, {m['layers']} layers, {m['heads']} heads, "
            f"{m['kv_heads']} KV heads, vocab {m['vocab']}"
        )
        title = (
            f"ringpass bench --what model: {described}, batch {c['batch']}, one training step, compiler {c['compiler']}"
        )
    else:
        title = (
            f"ringpass bench: {'causal' if c['causal'] else 'bidirectional'} attention, B={c['batch']} "
            f"Hq={c['heads']} Hkv={c['kv_heads']} D={c['head_dim']} {c['dtype']}, forward+backward"
            + (f", one row packed from {_documents_text(c['packed'])}" if c.get("packed") else "")
        )
    lines = [
        title,
        f"  {c['warmup']} warm-up call(s), {c['repeats']} measured; times: median (min..max) of the slowest "
        f"rank; memory: per-rank peak above the call's start; predicted on link {h['link']}, device {h['device']}",
        "",
    ]
    head = (
        f"{'method':<17}{'P':>3}{'thr':>4}{'N':>7}{'fwd s':>9}{'fwd+bwd s (min..max)':>26}{'pred s':>8}"
        f"{'MiB fwd/all':>13}{'need':>7}{'eff':>6}{'vs same':>8}"
    )
    head += f"{'tok/s':>9}{'loss err':>9}" if model else f"{'hidden':>7}{'bal':>6}{'pairs':>6}{'sent':>7}{'error':>9}"
    head += f"{'bal':>6}{'pairs':>6}" if model and c.get("packed") else ""
    lines.append(head)
    for r in summary["rows"]:
        start = f"{r['method']:<17}{r['world_size']:>3}{r['threads']:>4}{r['seq_len']:>7}"
        if "unavailable" in r:
            lines.append(f"{start}  unavailable: {r['unavailable']}")
            continue
        t = r["total_s"]
        total = f"{t['median']:.3f} ({t['min']:.3f}..{t['max']:.3f})"
        memory = f"{_fmt(r['forward_mib'], '.0f')}/{_fmt(r['total_mib'], '.0f')}"
        need = r.get("need_mib")
        line = (
            f"{start}{r['forward_s']['median']:>9.3f}{total:>26}{_fmt(r.get('predicted', {}).get('total_s'), '.3f'):>8}"
            f"{memory:>13}{_fmt(need and need['backward'], '.0f'):>7}{_fmt(r['efficiency'], '.2f'):>6}"
            f"{_fmt(r['vs_same_cores'], '.2f'):>8}"
        )
        if model:
            line += f"{r['tokens_per_s']:>9.0f}{_fmt(r.get('loss_error'), '.1e'):>9}"
            if c.get("packed"):
                line += f"{_fmt(r.get('balance'), '.2f'):>6}{_fmt(r.get('pairs_balance'), '.2f'):>6}"
            if r["method"] == "ring" and not r["exchanges"]:
                line += "  (no ring exchange: ran unsharded)"
        else:
            hidden = r.get("hidden")
            line += (
                f"{_fmt(hidden and 100 * hidden, '.0f') + ('%' if hidden is not None else ''):>7}"
                f"{_fmt(r.get('balance'), '.2f'):>6}{_fmt(r.get('pairs_balance'), '.2f'):>6}"
                f"{_fmt(r.get('sent_mib'), '.1f'):>7}{r['error']:>9.1e}"
            )
            line += f"  picked: {r['chosen']}" if r.get("chosen") else ""
        lines.append(line)
    notes = {r["memory_note"] for r in summary["rows"] if r.get("memory_note")}
    lines += [f"  memory not measured: {note}" for note in notes]
    lines.append(
        "  eff: T(1 thread, 1 process) / (cores x T); vs same: T(1 process, same cores) / T; need: the ring's "
        "working memory per rank (fwd+bwd)"
        + (
            "; bal / pairs: max/mean over ranks of the ring's compute seconds / of pairs scored"
            if not model or c.get("packed")
            else ""
        )
        + ("" if model else "; sent: MiB a rank sends per call")
    )
    return "\n".join(lines)


def _documents_text(lengths) -> str:
    """``1 x 24576 + 16 x 512`` for the title: each length with its count, longest first."""
    counts = {n: lengths.count(n) for n in sorted(set(lengths), reverse=True)}
    return f"{len(lengths)} documents (" + " + ".join(f"{k} x {n}" for n, k in counts.items()) + ")"


def _decode_table(summary: dict) -> str:
    """The table of ``--what decode`` (one attention) and ``--what generate`` (a model's decode steps)."""
    c, h = summary["config"], summary["hardware"]
    generate = c["what"] == "generate"
    if generate:
        m = c["model"]
        described = c["hf_config"] or (
            f"Llama-style hidden {m['hidden']}, {m['layers']} layers, {m['heads']} heads, {m['kv_heads']} KV heads"
        )
        title = (
            f"ringpass bench --what generate: {described}, batch {c['batch']}, a prompt of N tokens, then one "
            f"token per step, compiler {c['compiler']}"
        )
    else:
        title = (
            f"ringpass bench --what decode: {c['new_tokens']} new token(s) against a KV cache of N positions, "
            f"B={c['batch']} Hq={c['heads']} Hkv={c['kv_heads']} D={c['head_dim']} {c['dtype']}, causal, one attention"
        )
    lines = [
        title,
        f"  {c['warmup']} warm-up step(s), {c['repeats']} measured; per-step time: median (min..max) of the "
        f"slowest rank; cache: what one rank holds; peak: what the step adds"
        + ("" if generate else f"; predicted on link {h['link']}, device {h['device']}"),
        "",
        f"{'method':<10}{'P':>3}{'thr':>4}{'N':>9}{'step ms (min..max)':>24}{'pred ms':>9}{'cache MiB':>11}"
        f"{'peak MiB':>10}{'eff':>6}{'vs same':>8}{'merges':>7}" + (f"{'tokens':>8}" if generate else f"{'error':>9}"),
    ]
    for r in summary["rows"]:
        start = f"{r['method']:<10}{r['world_size']:>3}{r['threads']:>4}{r['seq_len']:>9}"
        t = {k: r["total_s"][k] * 1e3 for k in ("median", "min", "max")}
        step = f"{t['median']:.3f} ({t['min']:.3f}..{t['max']:.3f})"
        predicted = r.get("predicted", {}).get("total_s")
        line = (
            f"{start}{step:>24}{_fmt(predicted and predicted * 1e3, '.3f'):>9}{r['cache_mib']:>11.1f}"
            f"{_fmt(r['total_mib'], '.1f'):>10}{_fmt(r['efficiency'], '.2f'):>6}{_fmt(r['vs_same_cores'], '.2f'):>8}"
            f"{r['merges']:>7}"
        )
        if generate:
            same = r.get("same_tokens")
            line += f"{'-' if same is None else ('same' if same and r['same_on_every_rank'] else 'DIFFER'):>8}"
        else:
            line += f"{r['error']:>9.1e}"
        lines.append(line)
    lines.append(
        "  sharded: every rank reads its slots and the ranks merge out and LSE (one all-gather); gathered: every "
        "rank holds and reads the whole cache; eff: T(1 thread, 1 process) / (cores x T); vs same: "
        "T(1 process, same cores) / T" + ("; tokens: the same as the unsharded model's" if generate else "")
    )
    return "\n".join(lines)


def write_json(summary: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(summary, f, indent=1)


def plot(summary: dict, path: str) -> None:
    """A PNG: forward+backward time (top) and per-rank peak memory (bottom) against N, a line per method
    and world size."""
    try:
        import matplotlib
    except ImportError:
        raise InvalidInputError("--plot needs matplotlib: pip install 'ringpass[viz]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (time_axis, memory_axis) = plt.subplots(2, 1, figsize=(8, 8), sharex=True)
    series: dict = {}
    for r in summary["rows"]:
        if "total_s" in r:
            label = f"{r['method']} P={r['world_size']}" if r["world_size"] > 1 else f"{r['method']} {r['threads']} thr"
            series.setdefault(label, []).append(r)
    for label, rows in sorted(series.items()):
        rows.sort(key=lambda r: r["seq_len"])
        n = [r["seq_len"] for r in rows]
        time_axis.plot(n, [r["total_s"]["median"] for r in rows], marker="o", label=label)
        if all(r["total_mib"] is not None for r in rows):
            memory_axis.plot(n, [r["total_mib"] for r in rows], marker="o", label=label)
    time_axis.set_ylabel(
        "forward+backward s (median)" if summary["config"]["what"] == "attention" else "training step s"
    )
    memory_axis.set_ylabel("peak MiB per rank above start")
    memory_axis.set_xlabel("sequence length N")
    for axis in (time_axis, memory_axis):
        axis.set_xscale("log", base=2)
        axis.grid(True, alpha=0.3)
    time_axis.legend(fontsize=8)
    time_axis.set_title(format_table(summary).splitlines()[0][:90], fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
