"""gemm_amax on several devices: the partitioning rules checked with the kernel, then timed.

Usage (two or more GPUs, a few minutes):   python benchmarks/multi_gpu.py --out multi_gpu.json
On CPU (8 host devices, small sizes, the reference):   python benchmarks/multi_gpu.py --cpu --out multi_gpu.json

1. Checks on every visible device (MXFP8 E4M3 -> float32 C, implementation="cutedsl" on GPU, "xla" with --cpu):
   for L, M and N sharded and for the two shardings the rules gather on purpose (K and M off the scale atoms),
   under jax.jit and jax.vmap: C and amax equal the unsharded call bit for bit and the float64 oracle
   (SPEC §7), the compiled program all-gathers exactly where the rules say, runs the kernel (GPU), and returns C
   sharded like the operands. Then one program that uses all devices at once, each on its own batch entry: each
   device's shard is checked against the oracle on its own. Last, gemm_proj_rope_mxfp8 with tokens and with heads
   sharded (implementation=None: the kernel once one serves it, the reference until then).
2. Timing (median of --reps calls, block_until_ready, after warm-up): M = N = K = --size (8192 on GPU) with A's
   rows sharded over all devices, beside the unsharded call on one device, the reference sharded the same way and
   a hand-written shard_map around the kernel.
3. The training step of jax_blockgemm/examples/sharded_step.py (FSDP + tensor parallelism, MXFP8 layers and the
   bf16 nnx.Linear twin) on one device and on a (fsdp, tp) mesh of all of them, weak scaling: the global batch
   grows with the device count, so equal step times are 100% efficiency. --step-mesh picks the mesh.
Prints tables; writes everything as JSON to --out. Exits non-zero when a check fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys
import time
import traceback


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="path of the JSON record to write")
    parser.add_argument("--cpu", action="store_true", help="8 host CPU devices, small sizes, the reference")
    parser.add_argument("--size", type=int, default=None, help="M = N = K of the timed GEMM (8192; 1024 with --cpu)")
    parser.add_argument("--reps", type=int, default=20, help="timed calls per measurement (median reported)")
    parser.add_argument("--step-mesh", default=None, help="FSDPxTP of the training step's mesh (default: all "
                        "devices, tp = 4 from 8 devices, 2 from 4, else 1)")
    parser.add_argument("--no-step", action="store_true", help="skip the training step (part 3)")
    return parser.parse_args()


ARGS = _parse() if __name__ == "__main__" else None
if ARGS is not None and ARGS.cpu:  # before jax is imported
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = flags + " --xla_force_host_platform_device_count=8"
    os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jax_blockgemm as jbg  # noqa: E402
from jax_blockgemm import formats  # noqa: E402
from jax_blockgemm.bench.timing import median_ms  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
import oracle_ops  # noqa: E402  (the float64 oracle and SPEC §7 checks the test suite uses)

AXIS = "x"


class _Check:
    """What oracle_ops' assertions need of a test case: a fail() that raises."""

    def fail(self, msg: str) -> None:
        raise AssertionError(msg)


def _gathers(hlo: str) -> int:
    return sum(1 for line in hlo.splitlines() if " all-gather(" in line or " all-gather-start(" in line)


def _problem(rng, l, m, n, k):
    """Random MXFP8 E4M3 operands with random scales (atoms) and the float64 oracle's (C, amax)."""
    d = oracle_ops.random_gemm_inputs(rng, l=l, m=m, n=n, k=k, fmt="mxfp8_e4m3", scale_log2=(-3.0, 3.0))
    args = tuple(jnp.asarray(d[name]) for name in ("a", "b", "sfa_atom", "sfb_atom"))
    return args, oracle_ops.gemm_amax_oracle(d["a"], d["b"], d["sfa"], d["sfb"], k=k, sf_vec_size=32)


def _check_case(name, fn, args, specs, oracle, *, mesh, impl, gathers, c_spec, vmapped=False):
    """One sharding: bitwise equal to the unsharded call, close to the oracle, gathers as expected, kernel used."""
    record = {"name": name, "specs": [str(s) for s in specs]}
    try:
        sharded = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(args, specs)]
        jitted = jax.jit(fn)
        hlo = jitted.lower(*sharded).compile().as_text()
        record["all_gathers"] = _gathers(hlo)
        if (record["all_gathers"] > 0) != gathers:
            raise AssertionError(f"{record['all_gathers']} all-gathers in the program; expected "
                                 f"{'some' if gathers else 'none'}")
        if impl == "cutedsl" and 'custom_call_target="jbg_gemm_amax"' not in hlo:
            raise AssertionError("the compiled program does not call the kernel")
        c, amax = jitted(*sharded)
        want_c, want_amax = jax.jit(fn)(*args)
        record["bitwise_equal_to_unsharded"] = bool(np.array_equal(np.asarray(c), np.asarray(want_c)) and
                                                    np.array_equal(np.asarray(amax), np.asarray(want_amax)))
        if not record["bitwise_equal_to_unsharded"]:
            raise AssertionError("sharded and unsharded results differ")
        c_ref, amax_ref = oracle
        cs, amaxs = (np.asarray(c), np.asarray(amax)) if vmapped else (np.asarray(c)[None], np.asarray(amax))
        for i in range(cs.shape[0]):
            ref = c_ref[i] if vmapped else c_ref
            oracle_ops.assert_gemm_close(_Check(), cs[i], ref, c_dtype=np.float32)
            oracle_ops.assert_amax_close(_Check(), amaxs[i] if vmapped else amaxs, amax_ref[i] if vmapped else amax_ref)
        if c_spec is not None and not c.sharding.is_equivalent_to(NamedSharding(mesh, c_spec), c.ndim):
            raise AssertionError(f"C came back sharded {c.sharding.spec}, expected {c_spec}")
        record["c_sharding"] = str(c.sharding.spec)
        record["passed"] = True
    except Exception as e:  # a failing case is recorded and reported, never hidden
        record.update(passed=False, error=f"{type(e).__name__}: {str(e)[:400]}", trace=traceback.format_exc()[-800:])
    return record


def correctness(mesh, impl: str) -> list[dict]:
    nd = mesh.size
    rng = np.random.default_rng(2026)
    fn = jax.jit(lambda *x: jbg.gemm_amax(*x, implementation=impl))
    rows = P(None, AXIS)
    cases = []
    for name, (l, m, n, k), specs, gathers, c_spec in (
            ("batch L", (nd, 256, 200, 160), (P(AXIS),) * 4, False, P(AXIS)),
            ("rows M (odd N)", (1, 256 * nd, 200, 96), (rows, P(), rows, P()), False, rows),
            ("columns N (odd M)", (2, 136, 128 * nd, 256), (P(), rows, P(), rows), False, P(None, None, AXIS)),
            ("K off the scale atoms: gathered", (1, 256, 256, 64 * nd), (P(None, None, AXIS),) * 2 + (P(), P()),
             True, None),
            ("M off the 128-row atoms: gathered", (1, 64 * nd, 128, 64), (rows, P(), P(), P()), True, None)):
        args, oracle = _problem(rng, l, m, n, k)
        cases.append(_check_case(name, fn, args, specs, oracle, mesh=mesh, impl=impl, gathers=gathers,
                                 c_spec=c_spec))
    problems = [_problem(rng, 1, 256, 128, 128) for _ in range(nd)]
    stacked = tuple(jnp.stack([p[0][i] for p in problems]) for i in range(4))
    oracle = (np.stack([p[1][0] for p in problems]), np.stack([np.max(p[1][1]) for p in problems]))
    cases.append(_check_case("vmap over a sharded axis", jax.vmap(fn), stacked, (P(AXIS),) * 4, oracle, mesh=mesh,
                             impl=impl, gathers=False, c_spec=P(AXIS), vmapped=True))
    cases.append(all_devices_at_once(mesh, impl, rng))
    for name, (t, h), tok, w in (("proj_rope: tokens", (64 * nd, 2), P(AXIS), P()),
                                 ("proj_rope: heads", (64, 2 * nd), P(), P(AXIS))):
        cases.append(check_proj_rope(name, mesh, rng, t, h, tok, w))
    return cases


def check_proj_rope(name, mesh, rng, t, h, tok, w_spec) -> dict:
    """gemm_proj_rope_mxfp8 (MXFP8 path, implementation=None: whatever serves it on this device) with tokens or
    heads sharded: bitwise equal to the unsharded call, close to the oracle, no all-gather."""
    record = {"name": name, "specs": [str(tok), str(w_spec)]}
    try:
        d = oracle_ops.random_proj_rope_inputs(rng, t=t, h=h, k=128, mxfp8=True)
        names = ("x", "w", "cos", "sin", "x_scale", "w_scale")
        args = tuple(jnp.asarray(d[n]) for n in names)
        specs = (tok, w_spec, tok, tok, tok, w_spec)
        fn = jax.jit(lambda x, w, c, s, xs, ws: jbg.gemm_proj_rope_mxfp8(x, w, c, s, x_scale=xs, w_scale=ws))
        sharded = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(args, specs)]
        record["all_gathers"] = _gathers(fn.lower(*sharded).compile().as_text())
        if record["all_gathers"]:
            raise AssertionError(f"{record['all_gathers']} all-gathers in the program; expected none")
        got, want = fn(*sharded), fn(*args)
        if not all(np.array_equal(np.asarray(g).view(np.uint8), np.asarray(r).view(np.uint8))
                   for g, r in zip(got, want)):
            raise AssertionError("sharded and unsharded results differ")
        record["bitwise_equal_to_unsharded"] = True
        y_ref = oracle_ops.proj_rope_oracle(d["x"], d["w"], d["cos"], d["sin"], x_scale=d["x_scale"],
                                            w_scale=d["w_scale"])
        oracle_ops.assert_proj_rope_close(_Check(), [np.asarray(o) for o in got], y_ref)
        record.update(c_sharding=str(got[0].sharding.spec), passed=True)
    except Exception as e:
        record.update(passed=False, error=f"{type(e).__name__}: {str(e)[:400]}", trace=traceback.format_exc()[-800:])
    return record


def all_devices_at_once(mesh, impl: str, rng) -> dict:
    """One program, every device busy with its own batch entry; each device's shard checked on its own."""
    record = {"name": "all devices at once, each checked"}
    try:
        nd = mesh.size
        args, (c_ref, amax_ref) = _problem(rng, nd, 512, 384, 512)
        sharded = [jax.device_put(x, NamedSharding(mesh, P(AXIS))) for x in args]
        c, _ = jax.jit(lambda *x: jbg.gemm_amax(*x, implementation=impl))(*sharded)
        per_device = {}
        for shard in c.addressable_shards:
            l = shard.index[0].start
            local = np.asarray(shard.data)
            oracle_ops.assert_gemm_close(_Check(), local, c_ref[l:l + 1], c_dtype=np.float32)
            oracle_ops.assert_amax_close(_Check(), np.max(np.abs(local)), amax_ref[l])
            per_device[str(shard.device)] = f"batch {l}: ok"
        if len(per_device) != nd:
            raise AssertionError(f"{len(per_device)} devices returned a shard, expected {nd}")
        record.update(passed=True, devices=per_device)
    except Exception as e:
        record.update(passed=False, error=f"{type(e).__name__}: {str(e)[:400]}", trace=traceback.format_exc()[-800:])
    return record


def timing(mesh, impl: str, size: int, reps: int) -> dict:
    """size^3 with A's rows sharded over the mesh, beside one device, the reference and a hand-written shard_map."""
    key = jax.random.key(0)
    ka, kb, ks, kt = jax.random.split(key, 4)
    dev0 = mesh.devices.flat[0]
    a = jax.device_put((jax.random.normal(ka, (size, size)) * 4).astype(jnp.float8_e4m3fn), dev0)
    b = jax.device_put((jax.random.normal(kb, (size, size)) * 4).astype(jnp.float8_e4m3fn), dev0)
    sfa = formats.to_scale_atom(jax.random.randint(ks, (size, size // 32), 118, 136).astype(jnp.uint8))[0]
    sfb = formats.to_scale_atom(jax.random.randint(kt, (size, size // 32), 118, 136).astype(jnp.uint8))[0]
    sfa, sfb = jax.device_put(sfa, dev0), jax.device_put(sfb, dev0)
    rows, rep = NamedSharding(mesh, P(AXIS)), NamedSharding(mesh, P())
    sharded = (jax.device_put(a, rows), jax.device_put(b, rep), jax.device_put(sfa, rows), jax.device_put(sfb, rep))
    call = lambda implementation: jax.jit(lambda *x: jbg.gemm_amax(*x, implementation=implementation))

    def per_shard(a, b, sfa, sfb):
        c, amax = jbg.gemm_amax(a, b, sfa, sfb, implementation=impl)
        return c, jax.lax.pmax(amax, AXIS)

    shard_map = jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=(P(AXIS), P(), P(AXIS), P()),
                                      out_specs=(P(AXIS), P()), check_vma=False))
    result = {"shape": [size, size, size], "devices": mesh.size, "reps": reps}
    runs = (("one device", call(impl), (a, b, sfa, sfb)),
            ("rows sharded, jit (the rules)", call(impl), sharded),
            ("rows sharded, reference", call("xla"), sharded),
            ("rows sharded, hand-written shard_map", shard_map, sharded))
    want = None
    for name, fn, args in runs:
        try:
            hlo = fn.lower(*args).compile().as_text()
            c, amax = fn(*args)
            if want is None:
                want = (np.asarray(amax), np.asarray(c[:: max(1, size // 64)]))
            same = np.array_equal(np.asarray(amax), want[0]) and np.array_equal(np.asarray(c[:: max(1, size // 64)]),
                                                                             want[1])
            result[name] = {"ms": median_ms(fn, [args], warmup=3, reps=reps), "all_gathers": _gathers(hlo),
                            "kernel": 'custom_call_target="jbg_gemm_amax"' in hlo,
                            "same_result_as_one_device": bool(same)}
        except Exception as e:
            result[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    one = result["one device"].get("ms")
    for name, _, _ in runs[1:]:
        if one and "ms" in result[name]:
            result[name]["ratio_to_one_device"] = result[name]["ms"] / one
    return result


def _step_mesh_shape(devices: int, spec: str | None) -> tuple[int, int]:
    """(fsdp, tp) of the step's mesh: --step-mesh, else all devices with tp 4 (8+ devices), 2 (4+) or 1."""
    if spec:
        fsdp, tp = (int(v) for v in spec.lower().split("x"))
        return fsdp, tp
    tp = 4 if devices >= 8 else 2 if devices >= 4 else 1
    return devices // tp, tp


def training_step(devices: list, *, cpu: bool, reps: int, mesh_spec: str | None) -> dict:
    """Step time of the sharded training step (MXFP8 and bf16) on one device and on the (fsdp, tp) mesh, per-device
    work held constant (weak scaling): efficiency = one-device time / mesh time."""
    from jax_blockgemm.examples import sharded_step as ss

    fsdp, tp = _step_mesh_shape(len(devices), mesh_spec)
    per_device = dataclasses.replace(ss.SMALL, batch=4) if cpu else ss.BlockConfig(batch=2, seq=2048)
    result = {"mesh": {"fsdp": fsdp, "tp": tp}, "per_device_config": dataclasses.asdict(per_device), "reps": reps,
              "runs": {}}
    for layers in ("mxfp8", "bf16"):
        for shape in ((1, 1), (fsdp, tp)):
            name = f"{layers} {shape[0]}x{shape[1]}"
            try:
                config = dataclasses.replace(per_device, batch=per_device.batch * shape[0] * shape[1])
                mesh = ss.make_mesh(*shape, devices=devices)
                built = ss.build_train_step(config, mx=layers == "mxfp8", mesh=mesh)
                x, target = (built.put(a) for a in ss.make_batch(config, 0))
                compiled = built.step.lower(built.state, x, target).compile()
                state, loss = compiled(built.state, x, target)  # warm-up, and the state the timed steps start from
                run = lambda state: compiled(state, x, target)[1]
                ms = median_ms(run, [(state,)], warmup=1, reps=reps)
                result["runs"][name] = {"ms": ms, "devices": shape[0] * shape[1], "tokens": config.batch * config.seq,
                                        "loss": float(loss), "all_gathers": _gathers(compiled.as_text())}
            except Exception as e:
                result["runs"][name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    for layers in ("mxfp8", "bf16"):
        one, many = result["runs"][f"{layers} 1x1"], result["runs"][f"{layers} {fsdp}x{tp}"]
        if "ms" in one and "ms" in many:
            many["weak_scaling_efficiency"] = one["ms"] / many["ms"]
    mx, bf = result["runs"][f"mxfp8 {fsdp}x{tp}"], result["runs"][f"bf16 {fsdp}x{tp}"]
    if "ms" in mx and "ms" in bf:
        result["mxfp8_speedup_over_bf16"] = bf["ms"] / mx["ms"]
    return result


def main() -> int:
    args = ARGS or _parse()
    devices = jax.devices()
    if not args.cpu and devices[0].platform != "gpu":
        print("no GPU visible; run with --cpu for the CPU-device mode", file=sys.stderr)
        return 2
    impl = "xla" if args.cpu else "cutedsl"
    size = args.size or (1024 if args.cpu else 8192)
    mesh = Mesh(np.array(devices), (AXIS,))
    if size % (128 * mesh.size):
        print(f"--size {size} must be a multiple of 128 x {mesh.size} devices (whole scale atoms per shard)",
              file=sys.stderr)
        return 2
    record = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": " ".join(sys.argv),
              "device": devices[0].device_kind, "devices": len(devices), "jax": jax.__version__,
              "implementation": impl, "partitioner": "shardy" if jax.config.jax_use_shardy_partitioner else "gspmd"}
    record["checks"] = correctness(mesh, impl)
    record["timing"] = timing(mesh, impl, size, args.reps)
    if not args.no_step:
        record["training_step"] = training_step(devices, cpu=args.cpu, reps=args.reps, mesh_spec=args.step_mesh)
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(record, indent=1))

    print(f"{record['devices']} x {record['device']}, jax {record['jax']}, {impl}, {record['partitioner']}")
    print(f"{'check':40}{'result':>10}{'all-gathers':>13}  C sharding")
    for c in record["checks"]:
        print(f"{c['name']:40}{'ok' if c['passed'] else 'FAILED':>10}{c.get('all_gathers', ''):>13}  "
              f"{c.get('c_sharding', '')}")
        if not c["passed"]:
            print(f"    {c['error']}")
    t = record["timing"]
    print(f"\n{t['shape'][0]}^3 MXFP8 E4M3 -> f32, median of {t['reps']}:")
    print(f"{'run':40}{'ms':>10}{'x one':>8}{'all-gathers':>13}{'kernel':>8}{'same C':>8}")
    for name, row in t.items():
        if isinstance(row, dict):
            if "ms" in row:
                print(f"{name:40}{row['ms']:10.3f}{row.get('ratio_to_one_device', 1.0):8.2f}"
                      f"{row['all_gathers']:13}{str(row['kernel']):>8}{str(row['same_result_as_one_device']):>8}")
            else:
                print(f"{name:40}  {row['error']}")
    if "training_step" in record:
        ts = record["training_step"]
        print(f"\ntraining step (sharded_step.py), weak scaling, median of {ts['reps']}:")
        print(f"{'run':20}{'devices':>8}{'tokens':>8}{'ms':>10}{'efficiency':>12}{'all-gathers':>13}")
        for name, row in ts["runs"].items():
            if "ms" in row:
                eff = row.get("weak_scaling_efficiency")
                print(f"{name:20}{row['devices']:8}{row['tokens']:8}{row['ms']:10.3f}"
                      f"{'' if eff is None else f'{eff:.0%}':>12}{row['all_gathers']:13}")
            else:
                print(f"{name:20}  {row['error']}")
        if "mxfp8_speedup_over_bf16" in ts:
            print(f"on the mesh, bf16 step time / MXFP8 step time: {ts['mxfp8_speedup_over_bf16']:.2f}")
    failed = [c["name"] for c in record["checks"] if not c["passed"]]
    print(f"\nwrote {args.out}; {len(record['checks']) - len(failed)} of {len(record['checks'])} checks passed")
    return 1 if failed else 0

if __name__ == "__main__":
    sys.exit(main())
