"""Data at scale (issue #64): corpus preparation's tokens/s per core and peak RSS on two generated corpora ten times
apart in size, against the tokenizer alone on the same documents, with a kill and a resume; and one host's read
throughput against the rows/s each stage of configs/qwen3_1p7b_hydrahead.py consumes on 8 hosts.

    python bench/bench_data.py                          # 50 MB and 500 MB of text, 2 workers
    python bench/bench_data.py --sizes-mb 2 20 --out /tmp/bench_data_quick --no-record   # a quick check

Corpora (made under --root by this script, reused when there): .jsonl.zst shards of ~--file-mb MB of text each,
generated from the Wikipedia extract with a seeded generator: each document is 2-30 random paragraphs of random
articles behind a line with a random 12-digit id, so no two documents are equal.

Preparation: ``python -m hydrahead_jax.data.prepare --workers W`` (--shard_mb file_mb / 2: two files a shard). Tokens/s per core =
the store's tokens / the workers' CPU seconds (each shard's done.json: the worker process's CPU time for the
shard, its reading, both passes, tokenising and writing; the workers tokenise single-threaded). The largest corpus is
killed (SIGKILL to the process group) once ⌊files / 3⌋ shards are done and resumed by the same command; the
shards finished before the kill are kept (their done.json unchanged). Peak RSS: each worker's (its done.json,
getrusage) and the main process's (the summary), per corpus.

Tokenizer alone: the same documents, read into memory shard by shard (not timed), then ``encode_batch`` in batches of
64 single-threaded, CPU seconds timed, in W processes; its token count (+1 EOS per document) must equal the store's.

Reading: the largest store's train split through TensorStore (not held in memory, as a host of a 15B-token run reads
it), packed rows of each stage's sequence length, the rows of process 0 of 8 of each global batch (the recipe's
batch / 8), grain with --read-threads threads; rows/s after a warm-up. Needed: the rows/s of a step at --mfu of
8 H100s (989 TFLOP/s dense bf16 each) per host, at 6N FLOPs per token (N = Qwen3-1.7B's 1.72e9 matmul parameters,
lm_head included: the fewest FLOPs a token can take, so the most rows/s a step can ask for) and at 6N + attention
(6 L T H d_h per token: 28 layers, 16 x 128, causal).

Writes bench/results/data/bench_data.json and bench_data.png and the section "Data at scale" of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

RESULTS_DIR = ROOT / "bench" / "results" / "data"
SECTION = "## Data at scale: preparation and reading (bench_data.py, issue #64)"
H100_BF16 = 989e12
QWEN3 = {"layers": 28, "heads": 16, "head_dim": 128, "hidden": 2048, "mlp": 6144, "kv_heads": 8, "vocab": 151936}
STAGES = {"stage1": (512, 256), "stage2": (2048, 256), "stage3": (16384, 32)}  # seq_len, global batch (the recipe)


# ------------------------------------------------------------------------------------------------ corpora


def paragraphs() -> list[str]:
    from hydrahead_jax.data.corpus import load_enwiki_documents

    return [p for doc in load_enwiki_documents() for p in doc.split("\n\n") if len(p) > 80]


def make_corpus(folder: Path, megabytes: float, file_mb: float, seed: int) -> Path:
    """``megabytes`` of generated text in .jsonl.zst files of ~``file_mb`` each (see the module doc)."""
    import zstandard

    marker = folder / ".complete"
    if marker.exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    paras = paragraphs()
    rng = np.random.default_rng(seed)
    target, written, index = megabytes * 1e6, 0, 0
    while written < target:
        lines, size = [], 0
        while size < file_mb * 1e6 and written + size < target:
            picks = rng.integers(0, len(paras), rng.integers(2, 31))
            text = f"Record {rng.integers(10**11, 10**12)}\n\n" + "\n\n".join(paras[i] for i in picks)
            lines.append(json.dumps({"text": text}))
            size += len(text.encode())
        data = ("\n".join(lines) + "\n").encode()
        (folder / f"part-{index:05d}.jsonl.zst").write_bytes(zstandard.ZstdCompressor(level=3).compress(data))
        written += size
        index += 1
    marker.write_text(json.dumps({"text_bytes": written, "files": index}))
    return folder


# ------------------------------------------------------------------------------------------------ preparation


def prepare(source: Path, out: Path, workers: int, file_mb: float, kill_after: int | None) -> dict:
    """The CLI on ``source`` (killed once ``kill_after`` shards are done, then rerun); the summary of the run that
    completed it, with the wall seconds of all runs and what the kill left."""
    cmd = [
        sys.executable,
        "-m",
        "hydrahead_jax.data.prepare",
        "--source",
        str(source),
        "--out",
        str(out),
        "--tokenizer",
        "smollm2-135m",
        "--workers",
        str(workers),
        "--shard_mb",
        str(file_mb / 2),  # text compresses about 4x: two files of file_mb MB of text to a shard
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    killed = None
    start = time.perf_counter()
    if kill_after:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True, stdout=subprocess.DEVNULL)
        while len(list(out.glob("shards/*/done.json"))) < kill_after and proc.poll() is None:
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        kept = {str(p): p.stat().st_mtime_ns for p in out.glob("shards/*/done.json")}
        killed = {"after_seconds": round(time.perf_counter() - start, 1), "shards_done": len(kept)}
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    summary["wall_seconds_all_runs"] = round(time.perf_counter() - start, 1)
    if killed is not None:
        killed["kept_unchanged"] = all(Path(p).stat().st_mtime_ns == t for p, t in kept.items())
        killed["prepared_after_resume"] = summary["shards_prepared"]
        summary["killed"] = killed
    dones = [json.loads(p.read_text()) for p in sorted(out.glob("shards/*/done.json"))]
    summary["worker_cpu_seconds"] = round(sum(d["cpu_seconds"] for d in dones), 1)
    summary["worker_peak_rss_mb"] = max(d["peak_rss_mb"] for d in dones)
    summary["tokens_per_cpu_second"] = round(summary["tokens"] / summary["worker_cpu_seconds"], 1)
    return summary


def _tokenize_alone(path: str) -> tuple[int, int, float]:
    """(documents, tokens + one EOS each, CPU seconds of encode_batch) of one shard file, single-threaded."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from hydrahead_jax.data.sources import iter_documents, list_inputs
    from hydrahead_jax.models.tokenizer import load_tokenizer

    tok = load_tokenizer("smollm2-135m")
    docs = list(iter_documents(list_inputs(path)[0]))
    cpu = time.process_time()
    tokens = 0
    for i in range(0, len(docs), 64):
        tokens += sum(len(ids) + 1 for ids in tok.encode_batch(docs[i : i + 64]))
    return len(docs), tokens + len(docs) * len(tok.document_start), time.process_time() - cpu


def tokenizer_alone(source: Path, workers: int) -> dict:
    files = sorted(str(p) for p in source.glob("*.jsonl.zst"))
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        parts = pool.map(_tokenize_alone, files)
    docs, tokens, cpu = (sum(p[i] for p in parts) for i in range(3))
    return {"documents": docs, "tokens": tokens, "cpu_seconds": round(cpu, 1), "tokens_per_cpu_second": tokens / cpu}


def paired_ratio(source: Path, files: int, scratch: Path) -> dict:
    """Preparation against the tokenizer alone on the same file, back to back in this one process (single-threaded;
    the order alternates file by file, so a change of the machine's load hits both alike): per file the CPU seconds
    of ``prepare_shard`` on a one-file shard and of ``encode_batch`` over its documents (read beforehand)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from hydrahead_jax.data.preparation import ShardJob, plan_store, prepare_shard, resolve_source
    from hydrahead_jax.data.sources import iter_documents
    from hydrahead_jax.models.tokenizer import load_tokenizer

    tok = load_tokenizer("smollm2-135m")
    src = resolve_source(source, shard_bytes=1)
    subprocess.run(["rm", "-rf", str(scratch)], check=True)
    plan = plan_store(tok, src, scratch, shard_bytes=1)
    ratios = []
    for k in range(min(files, len(plan.shards))):
        docs = list(iter_documents(src.inputs[plan.shards[k][0]]))

        def alone(docs=docs):
            cpu = time.process_time()
            tokens = sum(len(ids) + 1 for i in range(0, len(docs), 64) for ids in tok.encode_batch(docs[i : i + 64]))
            return tokens, time.process_time() - cpu

        def prepared(k=k):
            job = ShardJob(str(scratch), k, src, plan.shards[k], tok, plan.settings, 64, False)
            done = prepare_shard(job)
            return sum(done["splits"][s]["tokens"] for s in done["splits"]), done["cpu_seconds"]

        first, second = (alone, prepared) if k % 2 == 0 else (prepared, alone)
        a, b = first(), second()
        (ta, ca), (tp, cp) = (a, b) if k % 2 == 0 else (b, a)
        assert ta == tp, (ta, tp)
        ratios.append((tp / cp) / (ta / ca))
    return {"files": len(ratios), "ratios": [round(r, 3) for r in ratios], "median": float(np.median(ratios))}


# ------------------------------------------------------------------------------------------------ reading


def needed_rows_per_s(seq_len: int, global_batch: int, mfu: float, hosts: int = 8) -> dict:
    """Rows/s one host's step consumes (see the module doc), at 6N and at 6N + attention FLOPs per token."""
    q = QWEN3
    attention = q["hidden"] * (q["heads"] * q["head_dim"]) * 2 + q["hidden"] * (q["kv_heads"] * q["head_dim"]) * 2
    n = q["layers"] * (attention + 3 * q["hidden"] * q["mlp"]) + q["hidden"] * q["vocab"]
    flops_host = 8 * H100_BF16 * mfu
    out = {"params_matmul": n, "rows_per_host_step": global_batch // hosts}
    for name, per_token in (("6N", 6 * n), ("6N+attn", 6 * n + 6 * q["layers"] * seq_len * q["heads"] * q["head_dim"])):
        out[name] = flops_host / per_token / seq_len
    return out


def read_rows_per_s(store: Path, seq_len: int, global_batch: int, threads: int, seconds: float) -> dict:
    """Rows/s of process 0 of 8 reading its rows of every global batch (TensorStore reads)."""
    import grain

    from hydrahead_jax.data.pipeline import PackedWindows, resolve_batch_rows, select_batch_rows
    from hydrahead_jax.data.store import CorpusStore

    corpus = CorpusStore(store, "train", max_in_memory_bytes=0)
    rows = resolve_batch_rows(global_batch, None, 0, 8)
    batches = select_batch_rows(PackedWindows(corpus, seq_len, seed=0), global_batch, rows)
    it = iter(batches.to_iter_dataset(grain.ReadOptions(num_threads=threads, prefetch_buffer_size=16)))
    for _ in range(3):
        next(it)
    start, n = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        n += len(next(it)["input_ids"])
    dt = time.perf_counter() - start
    return {"rows_per_s": n / dt, "tokens_per_s": n * seq_len / dt, "rows": n}


# ------------------------------------------------------------------------------------------------ report


def figure(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    sizes = [c["text_mb"] for c in result["corpora"]]
    ax = axes[0]
    ax.plot(sizes, [c["prepare"]["worker_peak_rss_mb"] for c in result["corpora"]], "o-", label="worker (max)")
    ax.plot(sizes, [c["prepare"]["peak_rss_mb"] for c in result["corpora"]], "s-", label="main process")
    ax.set(xscale="log", xlabel="corpus text", ylabel="peak RSS (MiB)", title="Peak RSS vs corpus size")
    ax.set_xticks(sizes, [f"{s:g} MB" for s in sizes])
    ax.minorticks_off()
    ax.set_ylim(0, 1.3 * max(c["prepare"]["peak_rss_mb"] for c in result["corpora"]))
    ax.legend(loc="lower right")
    ax = axes[1]
    x = np.arange(len(sizes))
    ax.bar(x - 0.2, [c["prepare"]["tokens_per_cpu_second"] / 1e3 for c in result["corpora"]], 0.4, label="prepare")
    ax.bar(x + 0.2, [c["alone"]["tokens_per_cpu_second"] / 1e3 for c in result["corpora"]], 0.4, label="tokenizer")
    ax.set(xticks=x, xticklabels=[f"{s:g} MB" for s in sizes], ylabel="k tokens / CPU-second", title="Per core")
    ax.legend()
    ax = axes[2]
    names = list(result["reading"])
    x = np.arange(len(names))
    ax.bar(x - 0.2, [result["reading"][s]["rows_per_s"] for s in names], 0.4, label="one host reads")
    ax.bar(x + 0.2, [result["reading"][s]["needed"]["6N"] for s in names], 0.4, label="step needs (6N)")
    ax.set(xticks=x, xticklabels=names, yscale="log", ylabel="rows / s per host", title="Reading vs need")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def markdown(result: dict) -> str:
    lines = [
        SECTION,
        "",
        f"- command: `{result['command']}`",
        f"- machine: {result['machine']}",
        "- corpora: generated .jsonl.zst files of Wikipedia-extract paragraphs (see bench_data.py); "
        f"{result['workers']} worker processes, two files (about 5 MB compressed) per output shard",
        "",
        "| corpus text | files (compressed) | documents | tokens | = tokenizer's count | prepare tok/s/core | "
        "tokenizer alone tok/s/core | ratio | wall (all runs) | worker peak RSS | main peak RSS |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in result["corpora"]:
        p, a = c["prepare"], c["alone"]
        lines.append(
            f"| {c['text_mb']:g} MB | {c['files']} ({c['compressed_mb']:.0f} MB) | {p['documents']:,} | "
            f"{p['tokens']:,} | {'yes' if p['tokens'] == a['tokens'] else 'NO'} | {p['tokens_per_cpu_second']:,.0f} | "
            f"{a['tokens_per_cpu_second']:,.0f} | {p['tokens_per_cpu_second'] / a['tokens_per_cpu_second']:.2f}x | "
            f"{p['wall_seconds_all_runs']:.0f} s | {p['worker_peak_rss_mb']:.0f} MiB | {p['peak_rss_mb']:.0f} MiB |"
        )
    paired = result["paired"]
    lines += [
        "",
        f"Paired, the same file back to back in one process (alternating order, {paired['files']} files of the "
        f"largest corpus): preparation / tokenizer alone per CPU-second = {paired['median']:.2f}x median "
        f"(per file {', '.join(f'{r:.2f}' for r in paired['ratios'])}).",
    ]
    for c in result["corpora"]:
        k = c["prepare"].get("killed")
        if k:
            lines += [
                "",
                f"Kill and resume ({c['text_mb']:g} MB): SIGKILL after {k['after_seconds']} s with "
                f"{k['shards_done']} of {c['prepare']['shards']} shards done; the rerun prepared {k['prepared_after_resume']} "
                f"shards and left the finished ones' done.json {'unchanged' if k['kept_unchanged'] else 'CHANGED'}.",
            ]
    lines += [
        "",
        f"Reading (the {result['corpora'][-1]['text_mb']:g} MB store through TensorStore, process 0 of 8's rows, "
        f"{result['read_threads']} grain threads) against a step of configs/qwen3_1p7b_hydrahead.py at "
        f"{result['mfu']:.0%} MFU of 8x H100 per host (N = {result['params_matmul'] / 1e9:.2f}e9):",
        "",
        "| stage | seq | rows / host / step | one host reads rows/s | needs rows/s (6N) | needs (6N+attn) | margin (6N) |",
        "|---|---|---|---|---|---|---|",
    ]
    for s, r in result["reading"].items():
        lines.append(
            f"| {s} | {r['seq_len']} | {r['needed']['rows_per_host_step']} | {r['rows_per_s']:,.0f} | "
            f"{r['needed']['6N']:,.1f} | {r['needed']['6N+attn']:,.1f} | {r['rows_per_s'] / r['needed']['6N']:,.0f}x |"
        )
    lines += [
        "",
        "Reading the table: tokens/s per core are tokens per CPU-second of the workers (prepare) and of the "
        "tokenizer processes (alone), measured minutes apart on a shared 2-core box, so their ratio moves with the "
        "load between the two; the paired line compares the same files back to back and is the figure to quote. A "
        "worker's peak RSS is the highest over the shards it prepared before it was replaced (at most 4): the 50 MB "
        "corpus's workers prepared 1-2 shards each, the 500 MB corpus's 4, so ten times the corpus adds the spread "
        "of a few more shards' peaks, not memory that grows with it; the main process holds the tokenizer and "
        "the shard list.",
        "",
        "![data](results/data/bench_data.png)",
        "",
    ]
    return "\n".join(lines)


def record(text: str) -> None:
    """Replace the section in bench/RESULTS.md (or add it before the log)."""
    path = ROOT / "bench" / "RESULTS.md"
    doc = path.read_text()
    if SECTION in doc:
        start = doc.index(SECTION)
        end = doc.find("\n## ", start + len(SECTION))
        doc = doc[:start] + text + ("\n" + doc[end + 1 :] if end >= 0 else "")
    else:
        at = doc.index("\n## Log")
        doc = doc[: at + 1] + text + "\n" + doc[at + 1 :]
    path.write_text(doc)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[50, 500])
    ap.add_argument("--file-mb", type=float, default=10.0, help="MB of text per generated file")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--root", default="/tmp/hydrahead_bench_data", help="where corpora and stores go")
    ap.add_argument("--paired-files", type=int, default=8, help="files of the paired prepare/tokenizer comparison")
    ap.add_argument("--read-threads", type=int, default=2)
    ap.add_argument("--read-seconds", type=float, default=20.0)
    ap.add_argument("--mfu", type=float, default=0.4)
    ap.add_argument("--out", default=str(RESULTS_DIR))
    ap.add_argument("--no-record", action="store_true", help="do not write bench/RESULTS.md")
    ap.add_argument("--render", action="store_true", help="only redraw the figure and section from --out's JSON")
    args = ap.parse_args()
    if args.render:
        result = json.loads((Path(args.out) / "bench_data.json").read_text())
        figure(result, Path(args.out) / "bench_data.png")
        record(markdown(result))
        return
    from _common import machine_line

    root, out = Path(args.root), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "command": "python bench/bench_data.py " + " ".join(sys.argv[1:]),
        "machine": machine_line(),
        "workers": args.workers,
        "read_threads": args.read_threads,
        "mfu": args.mfu,
        "corpora": [],
    }
    for i, mb in enumerate(args.sizes_mb):
        source = make_corpus(root / f"corpus_{mb:g}mb", mb, args.file_mb, seed=i)
        files = sorted(source.glob("*.jsonl.zst"))
        store = root / f"store_{mb:g}mb"
        subprocess.run(["rm", "-rf", str(store)], check=True)
        largest = i == len(args.sizes_mb) - 1
        prep = prepare(
            source, store, args.workers, args.file_mb, kill_after=max(1, len(files) // 3) if largest else None
        )
        alone = tokenizer_alone(source, args.workers)
        entry = {
            "text_mb": mb,
            "files": len(files),
            "compressed_mb": sum(f.stat().st_size for f in files) / 1e6,
            "prepare": prep,
            "alone": alone,
        }
        result["corpora"].append(entry)
        print(json.dumps(entry), flush=True)
    result["paired"] = paired_ratio(root / f"corpus_{args.sizes_mb[-1]:g}mb", args.paired_files, root / "paired")
    print("paired", json.dumps(result["paired"]), flush=True)
    store = root / f"store_{args.sizes_mb[-1]:g}mb"
    result["reading"] = {}
    for stage, (seq_len, batch) in STAGES.items():
        read = read_rows_per_s(store, seq_len, batch, args.read_threads, args.read_seconds)
        need = needed_rows_per_s(seq_len, batch, args.mfu)
        result["params_matmul"] = need.pop("params_matmul")
        result["reading"][stage] = dict(read, seq_len=seq_len, needed=need)
        print(stage, json.dumps(result["reading"][stage]), flush=True)
    (out / "bench_data.json").write_text(json.dumps(result, indent=1))
    figure(result, out / "bench_data.png")
    text = markdown(result)
    print(text)
    if not args.no_record:
        record(text)


if __name__ == "__main__":
    main()
