"""Compile-only memory plan: the per-device memory of every training stage of a recipe on a given mesh, without
weights, data or accelerators (abstract shapes, XLA memory analysis on simulated CPU devices).

    python bench/memory_plan.py --config configs/qwen3_1p7b_hydrahead.py:7to1 --shapes qwen3 \
        --devices 8 --mesh fsdp=8 --device_memory_gb 80 --fit

The model shapes come from ``--shapes`` (a table of bench_attention.py), ``--model_config`` (a Hugging Face
config.json), the teacher folder named by the recipe when it exists, or the recipe's own ``teacher.model`` for a
random teacher; parameters use the recipe's teacher dtype. The head map has the recipe's FA budget (ratio,
allocation; ``random`` groups stand in for probe-selected ones: the memory depends on the count per layer only).
``--fit`` compiles larger ``micro_batches`` until each stage fits ``--device_memory_gb`` (95 % of it, leaving room
for the runtime) and prints the setting. By default the figures are XLA CPU compiles (a GPU/TPU compile fuses
differently); ``--platform tpu --topology v5p:4x4x2`` compiles each stage with the real TPU compiler for every chip
of that slice (libtpu's compile-only devices, no TPU needed: pallas_kernels.cross_compile), the Pallas TPU kernels
included, and holds the per-chip figure against the chip's HBM (libtpu from `make libtpu`'s folder):

    PYTHONPATH=.venv/libtpu python bench/memory_plan.py --config configs/qwen3_1p7b_hydrahead.py:7to1 \
        --shapes qwen3 --platform tpu --topology v5p:4x4x2     # 32 v5p chips (Cloud TPU's "v5p-64")
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

STAGES = ("align", "distil", "long")
HEADROOM = 0.95  # of the device memory: CUDA context, NCCL buffers and fragmentation live outside XLA's plan


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="a recipe file, optionally with :variant (configs/x.py:7to1)")
    p.add_argument("--devices", type=int, default=8, help="simulated devices (the mesh must use all of them)")
    p.add_argument("--platform", choices=("cpu", "tpu"), default="cpu", help="cpu: simulated devices; tpu: libtpu")
    p.add_argument("--topology", default="", help="with --platform tpu: the slice, e.g. v5p:4x4x2 or v5e:4x4")
    p.add_argument("--mesh", default="", help="mesh sizes overriding the recipe's, e.g. fsdp=8 or data=4,fsdp=8")
    p.add_argument(
        "--device_memory_gb",
        type=float,
        default=0.0,
        help="memory of one device (GB = 1e9 bytes; 0: 80, or the TPU's HBM)",
    )
    p.add_argument("--shapes", default="", help="model shapes from bench_attention.SHAPES (e.g. qwen3)")
    p.add_argument("--model_config", default="", help="a Hugging Face config.json giving the model shapes")
    p.add_argument("--layers", type=int, default=0, help="override the layer count (quick looks; 0 = the model's)")
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {STAGES}")
    p.add_argument("--fit", action="store_true", help="search the smallest micro_batches that fits each stage")
    args = p.parse_args(argv)
    if args.devices < 1:
        p.error("--devices must be >= 1")
    if (args.platform == "tpu") != bool(args.topology):
        p.error("--platform tpu needs --topology (e.g. v5p:4x4x2), and --topology needs --platform tpu")
    bad = [s for s in args.stages.split(",") if s not in STAGES]
    if bad:
        p.error(f"--stages: unknown {bad}; choose from {STAGES}")
    return args


def load_recipe(spec: str):
    path, _, variant = spec.partition(":")
    path = Path(path)
    if not path.exists():
        raise SystemExit(f"--config {path}: no such file.")
    module_spec = importlib.util.spec_from_file_location(f"recipe_{path.stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.get_config(variant or None)


def model_config(run, args):
    import json

    from hydrahead_jax.models.loaders import config_from_hf

    teacher = run.teacher
    if args.shapes:
        from bench_attention import SHAPES

        if args.shapes not in SHAPES:
            raise SystemExit(f"--shapes {args.shapes!r}; choose one of {sorted(SHAPES)}.")
        cfg = SHAPES[args.shapes]
    elif args.model_config:
        cfg = config_from_hf(json.loads(Path(args.model_config).read_text()), args.model_config)
    elif teacher.source == "random":
        cfg = teacher.model
    elif (Path(teacher.source) / "config.json").exists():
        cfg = config_from_hf(json.loads((Path(teacher.source) / "config.json").read_text()), teacher.source)
    else:
        raise SystemExit(
            f"teacher.source={teacher.source!r} is not a folder with a config.json here: give the model shapes "
            "with --shapes (e.g. qwen3) or --model_config path/to/config.json."
        )
    if teacher.source != "random":  # load_pretrained sets both dtypes to teacher.dtype
        cfg = cfg.replace(param_dtype=teacher.dtype, dtype=teacher.dtype)
    return cfg.replace(num_layers=args.layers) if args.layers else cfg


def plan_head_map(run, cfg):
    from hydrahead_jax.hybrid import HeadMap
    from hydrahead_jax.selection.select import select_fa_groups

    sel = run.selection
    if sel.method in ("all_fa", "all_la"):
        return HeadMap.all_fa(cfg) if sel.method == "all_fa" else HeadMap.all_la(cfg)
    if sel.method == "given":
        return HeadMap.load(sel.head_map_path, cfg)
    method = "layerwise" if sel.method == "layerwise" else "random"
    groups = select_fa_groups(
        None,
        ratio=sel.settings.ratio,
        allocation=sel.settings.allocation,
        method=method,
        seed=run.seed,
        num_layers=cfg.num_layers,
        num_groups=cfg.num_kv_heads,
        layerwise_cfg=cfg,
    )
    return HeadMap.from_fa_groups(cfg, groups, method=f"plan:{method}", target_ratio=sel.settings.ratio)


def _libtpu_version() -> str:
    from importlib.metadata import version

    return version("libtpu")


def main(argv=None):
    args = parse_args(argv)
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={args.devices}"])
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    from hydrahead_jax.run_config import STAGES, RunConfig
    from hydrahead_jax.training import memory
    from hydrahead_jax.training import sharding as shd

    run = RunConfig.from_recipe(load_recipe(args.config))
    sizes = dataclasses.asdict(run.mesh)
    for item in filter(None, args.mesh.split(",")):
        name, _, value = item.partition("=")
        if name not in sizes:
            raise SystemExit(f"--mesh {item!r}: axis {name!r} is not one of {tuple(sizes)}.")
        sizes[name] = int(value)
    if "data=" not in args.mesh and -1 not in sizes.values():
        sizes["data"] = -1  # the data axis fills the devices the other axes leave
    device_bytes = args.device_memory_gb * 1e9 or 80e9
    if args.platform == "tpu":
        from pallas_kernels import cross_compile

        devices = cross_compile.tpu_devices(args.topology)
        kind = devices[0].device_kind
        device_bytes = args.device_memory_gb * 1e9 or cross_compile.TPU_HBM_BYTES[kind]
        where = f"{len(devices)} {kind} chips of {args.topology} (libtpu {_libtpu_version()}, compile-only)"
    else:
        devices = jax.devices()[: args.devices]
        where = f"{args.devices} simulated CPU devices"
    mesh = shd.make_mesh(**sizes, devices=devices)
    cfg = model_config(run, args)
    head_map = plan_head_map(run, cfg)
    limit = int(device_bytes * HEADROOM)
    print(
        f"# {args.config}: {cfg.name}, {cfg.num_layers} layers, vocab {cfg.vocab_size}, params {cfg.param_dtype}; "
        f"head map {head_map.num_fa_groups()} FA groups of {cfg.num_layers * cfg.num_kv_heads}; "
        f"mesh {dict(mesh.shape)} on {where}; budget {limit / memory.GiB:.1f} GiB per device "
        f"({HEADROOM:.0%} of {device_bytes / memory.GiB:.1f} GiB)",
        flush=True,
    )
    data_parallel = int(mesh.shape["data"]) * int(mesh.shape["fsdp"])
    header = "| stage | batch × seq | micro_batches | loss tile rows/device × tokens | arguments | temporaries | peak / device | fits |"
    print(header, flush=True)
    print("|" + "---|" * (header.count("|") - 1), flush=True)
    for kind in args.stages.split(","):
        stage = next((s for s in STAGES if s.name == kind), None)
        if stage is None:
            raise SystemExit(f"--stages: {kind!r} is not one of {[s.name for s in STAGES]}.")
        key, scfg = stage.config_key, run.stage(stage)
        m = scfg.micro_batches
        valid = memory.valid_micro_batches(scfg.batch_size, data_parallel)
        if not valid:
            raise SystemExit(
                f"{key}: batch_size={scfg.batch_size} cannot be split over {data_parallel} data-parallel devices."
            )
        candidates = [c for c in valid if c >= m] or valid[-1:]  # the recipe's M, or the most this mesh allows
        m = candidates[0]
        while True:
            start = time.perf_counter()
            usage = memory.plan_stage(run, kind, cfg, head_map, mesh, micro_batches=m)
            seconds = time.perf_counter() - start
            fits = usage.peak <= limit
            rows = scfg.batch_size // m // data_parallel
            tile_rows = scfg.loss_chunk_rows or rows
            print(
                f"| {key} {kind} | {scfg.batch_size} × {scfg.seq_len} | {m} ({rows} row(s)/device) | "
                f"{tile_rows} × {scfg.loss_chunk} | {usage.arguments / memory.GiB:.2f} GiB | "
                f"{usage.temporaries / memory.GiB:.2f} GiB | {usage.peak / memory.GiB:.2f} GiB | "
                f"{'yes' if fits else 'NO'} |  <!-- compiled in {seconds:.0f} s -->",
                flush=True,
            )
            if fits or not args.fit:
                break
            larger = [c for c in candidates if c > m]
            if not larger:
                print(f"# {key}: does not fit even at one row per device; more fsdp devices or shorter rows.")
                break
            guess = memory.suggest_micro_batches(
                usage, limit, micro_batches=m, batch_size=scfg.batch_size, data_parallel=data_parallel
            )
            m = guess if guess is not None else larger[0]


if __name__ == "__main__":
    main()
