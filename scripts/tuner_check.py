"""The tuner's GPU checks in one command, for the GPU it runs on (the H200 its target; at most 7 minutes:
each step has its own time limit):

    python3 scripts/tuner_check.py [OUT]        (default OUT: ./bench-results/tuner-check)

1. ``validate`` (100 s): ``flashgen tune --gpu GPU --d 64,128 --seqlens 1024,4096 --causal both
   --validate-model --trials 16``: the cost model's pick against the measured best on 8 forward keys
   (regret, Spearman); OUT/validate/validation.json, OUT/validate.log.
2. ``record`` (240 s): a random-weight Llama-architecture model (transformers, ``attn_implementation="fgen"``;
   ``MODEL``: 4 layers, GQA 16/4 heads of d 64) generating 16 tokens past a 1999-token prompt and taking
   a training step on 2 x 4096 tokens, under ``flashgen.record``; then ``flashgen tune --from`` the shapes
   file (in this process, the space ``SPACE``, small enough that every candidate is measured), each tuned
   key timed at its recorded shape with the spec it ran before against the one it runs now (and against itself:
   ``control``, the timing's spread at that key), and the model's two phases untuned against tuned
   (interleaved rounds: the user's table moved aside and back);
   OUT/record/record.json.
3. ``autotune`` (40 s + 20 s): a process with ``FLASHGEN_AUTOTUNE=1`` (budget 15 s) makes the first call of a
   key no table has (d 96, GQA 16/4, 3001 tokens): its time, the stored entry, the output against the fp32
   reference; a second process: its first call of that key (no search: read from the table), and the
   stored spec timed against the default rule's; OUT/autotune/first.json, again.json.

OUT/summary.txt: one line per step (exit status, seconds) and the figures; printed at the end. Every step
shares one fresh FLASHGEN_HOME (this host's NVRTC compiles every kernel). ``--step NAME DIR`` runs one
step in this process (what the orchestrator starts).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)


def _gpu() -> str:
    """The profile of the GPU this runs on (its tables, its tune), the H200's where the device is none we know."""
    from flashgen import gpus

    prof = gpus.detect()
    return prof.name if prof else "h200"


GPU = _gpu()
VALIDATE = ["--gpu", GPU, "--d", "64,128", "--seqlens", "1024,4096", "--causal", "both", "--validate-model",
            "--trials", "16"]
# tune --from: the forward's tiles, stages and the persistent kernel searched (the softmax flags held at
# the shipped winners' most common values), so every candidate is measured: about 50 forward and 33
# backward candidates per key at d 64.
SPACE = ["block_m=64,128,192", "block_n=64,96,128", "stages=2,3", "early_k_release=false", "lean_softmax=true",
         "fma_exp2=0", "softmax_overlap=true", "pingpong=false", "refill=0", "warps=4"]
# Step 2's model: Llama architecture, random weights, GQA 16/4 heads of d 64; one 1999-token prompt
# generating 16 tokens, and a training step on 2 rows of 4096 tokens (shapes far from the tables'
# benchmark convention of hidden 2048 and 16k tokens per call).
MODEL = dict(layers=4, hidden=1024, heads=16, kv_heads=4, intermediate=2816, vocab=32000, prompt=1999,
             new_tokens=16, train_rows=2, train_seqlen=4096)
NEW_KEY = dict(batch=2, heads=16, heads_kv=4, seqlen=3001, d=96)
BUDGET_S = 15


def _dump(path, doc):
    with open(path, "w") as fh:
        json.dump(doc, fh, indent=1, default=str)


def _interleaved(fns: dict, rounds: int = 5) -> dict:
    """name -> median ms over ``rounds`` interleaved rounds of ``bench.timing.time_ms``, the calls queued ahead of
    the GPU (``ahead``, as the tuner's trials: the recorded decode steps and prefill are shorter than their host
    work, which per-call events would time)."""
    import statistics

    from flashgen.bench.timing import time_ms

    times = {name: [] for name in fns}
    for r in range(rounds):
        for name in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
            times[name].append(time_ms(fns[name], budget_s=0.1, ahead=True)["ms"])
    return {name: statistics.median(v) for name, v in times.items()}


# -- step 2 ------------------------------------------------------------------------------------------
def _model():
    """The random-weight Llama-architecture model of step 2 (transformers, ``attn_implementation="fgen"``)."""
    import torch
    import transformers

    from flashgen.integrations import transformers as hf

    m = MODEL
    cfg = transformers.LlamaConfig(hidden_size=m["hidden"], intermediate_size=m["intermediate"],
                                   num_hidden_layers=m["layers"], num_attention_heads=m["heads"],
                                   num_key_value_heads=m["kv_heads"], vocab_size=m["vocab"],
                                   max_position_embeddings=max(m["prompt"] + m["new_tokens"], m["train_seqlen"]),
                                   tie_word_embeddings=False, attention_dropout=0.0)
    torch.manual_seed(0)
    with torch.device("cuda"):
        return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16,
                                                             attn_implementation=hf.register())


def _phases(model):
    """{phase: a call}: one prompt generated ``new_tokens`` greedy tokens past (its prefill, then decode
    steps), and one training step (forward with labels, ``loss.backward()``)."""
    import torch

    m = MODEL
    gen = torch.Generator(device="cuda").manual_seed(0)
    prompt = torch.randint(1, m["vocab"], (1, m["prompt"]), device="cuda", generator=gen)
    rows = torch.randint(1, m["vocab"], (m["train_rows"], m["train_seqlen"]), device="cuda", generator=gen)

    def generate():
        model.eval()
        with torch.no_grad():
            model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=m["new_tokens"],
                           min_new_tokens=m["new_tokens"], do_sample=False, pad_token_id=0)

    def train():
        model.train()
        model(rows, labels=rows).loss.backward()
        model.zero_grad(set_to_none=True)

    return {"generate": generate, "train": train}


def _table_switch(path):
    """A function that makes dispatch read the user's table at ``path`` (True) or run without it (False),
    by moving the file aside: the model's untuned and tuned runs in the same interleaved rounds."""
    from flashgen import dispatch

    aside = str(path) + ".aside"

    def use(tuned: bool):
        src, dst = (aside, path) if tuned else (path, aside)
        if os.path.exists(src):
            os.replace(src, dst)
        dispatch.clear()
    return use


def step_record(out: str) -> int:
    import torch

    import flashgen
    from flashgen import dispatch, gpus, shapes, tables
    from flashgen.api import attention_backward
    from flashgen.api.device import Device
    from flashgen.cli import main
    from flashgen.tuner import space
    from flashgen.tuner.run import recorded_keys

    dt = torch.bfloat16
    model = _model()
    phases = _phases(model)
    path = os.path.join(out, "shapes.yaml")
    t0 = time.monotonic()
    with flashgen.record(path):
        for call in phases.values():
            call()
        torch.cuda.synchronize()
    recorded = shapes.by_key(shapes.load(path))
    dev = Device.of(0)
    tuned_kinds = [k for k in recorded if k.kind in space.TUNED_PROBLEMS and not (space.is_backward(k.kind)
                                                                                  and k.variant)]
    before = {k: dispatch.select(k, dev.gpu, dev.smem_budget, verify=True) for k in tuned_kinds}
    doc = {"model": {**MODEL, "head_dim": MODEL["hidden"] // MODEL["heads"],
                     "parameters": sum(p.numel() for p in model.parameters())},
           "recorded": {space.key_name(k): {"shape": s, "calls": c} for k, (s, c) in recorded.items()},
           "record_s": time.monotonic() - t0,
           "not_tuned": recorded_keys(path, gpus.get(GPU))[2]}  # what tune --from prints even with --quiet
    t1 = time.monotonic()
    code = main(["tune", "--gpu", GPU, "--from", path, "--trials", "80", "--space", *SPACE, "--quiet"])
    doc.update({"tune_exit": code, "tune_s": time.monotonic() - t1, "keys": []})
    dispatch.clear()
    for key in tuned_kinds:
        after = dispatch.select(key, dev.gpu, dev.smem_budget, verify=True)
        kb, kh, khk, nq, nk, kd = recorded[key][0]
        q = torch.randn(kb, kh, nq, kd, device="cuda", dtype=dt)
        k, v = (torch.randn(kb, khk, nk, kd, device="cuda", dtype=dt) for _ in range(2))
        if space.is_backward(key.kind):
            o, lse = flashgen.attention(q, k, v, causal=key.causal, return_lse=True)
            dout = torch.randn_like(q)
            mode = space.BWD_KEY_MODES[key.kind]

            def run(spec, key=key, q=q, k=k, v=v, o=o, lse=lse, dout=dout, mode=mode):
                return attention_backward(dout, q, k, v, o, lse, key.causal, kd ** -0.5, dq_mode=mode,
                                          specs={key.kind: spec})
        else:
            def run(spec, key=key, q=q, k=k, v=v):
                return flashgen.attention(q, k, v, causal=key.causal, spec=spec)
        # "control": the spec it ran before, timed again in the same rounds (a new spec object, as "after" is): the
        # timing's own spread at this key, which a gain must clear to count
        ms = _interleaved({"before": lambda: run(before[key]), "after": lambda: run(after),
                           "control": lambda: run(before[key].replace())})
        doc["keys"].append({"key": space.key_name(key), "shape": recorded[key][0], "calls": recorded[key][1],
                            "before": before[key].name, "after": after.name, "before_ms": ms["before"],
                            "after_ms": ms["after"], "gain": ms["before"] / ms["after"],
                            "control": ms["before"] / ms["control"]})
    # The whole model, untuned against tuned, in the same rounds (the table moved aside and back once per
    # round and state; time_ms's warm-up calls select and load that state's kernels).
    import statistics

    from flashgen.bench.timing import time_ms

    use = _table_switch(tables.default_path(GPU))
    times = {(name, state): [] for name in phases for state in ("untuned", "tuned")}
    for r in range(5):
        for state in (("untuned", "tuned") if r % 2 == 0 else ("tuned", "untuned")):
            use(state == "tuned")
            for name, call in phases.items():
                times[(name, state)].append(time_ms(call, budget_s=0.5, max_reps=10)["ms"])
    use(True)
    doc["model_ms"] = {f"{name} {state}": statistics.median(v) for (name, state), v in times.items()}
    # each state's rounds, and their spread ((max - min) / median): the noise a model gain is read against
    doc["model_rounds_ms"] = {f"{name} {state}": v for (name, state), v in times.items()}
    doc["model_spread"] = {f"{name} {state}": (max(v) - min(v)) / statistics.median(v)
                           for (name, state), v in times.items()}
    doc["model_gain"] = {name: statistics.median(times[(name, "untuned")]) / statistics.median(times[(name, "tuned")])
                         for name in phases}
    _dump(os.path.join(out, "record.json"), doc)
    return 0 if code == 0 else 1


# -- step 3 ------------------------------------------------------------------------------------------
def _new_key_inputs():
    import torch

    torch.manual_seed(1)
    K = NEW_KEY
    q = torch.randn(K["batch"], K["heads"], K["seqlen"], K["d"], device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(K["batch"], K["heads_kv"], K["seqlen"], K["d"], device="cuda", dtype=torch.bfloat16)
            for _ in range(2))
    return q, k, v


def _key():
    from flashgen.api.device import Device
    from flashgen.problem import ProblemKey, bucket_of, head_dim_tile

    return ProblemKey("fwd", Device.of(0).arch, "bf16", head_dim_tile(NEW_KEY["d"]), True, bucket_of(NEW_KEY["seqlen"]))


class _Lines(list):
    def write(self, text):
        self.extend(line for line in text.splitlines() if line.strip())


def _logged():
    import logging

    lines = _Lines()
    handler = logging.StreamHandler(lines)
    logging.getLogger("flashgen").addHandler(handler)
    return lines


def step_autotune(out: str, again: bool) -> int:
    import torch

    import flashgen
    from flashgen import families, tables
    from flashgen.api.device import Device
    from flashgen.reference import tolerance

    q, k, v = _new_key_inputs()
    torch.cuda.synchronize()  # CUDA started before the timed call
    key, dev = _key(), Device.of(0)
    had = tables.lookup(dev.gpu, key)
    lines = _logged()
    t0 = time.perf_counter()
    o = flashgen.attention(q, k, v, causal=True)
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    flashgen.attention(q, k, v, causal=True)
    torch.cuda.synchronize()
    second_s = time.perf_counter() - t0
    ref, tol = tolerance(q, k, v, True, NEW_KEY["d"] ** -0.5)
    err = (o.float() - ref).abs().max().item()
    stored = tables.lookup(dev.gpu, key)
    doc = {"key": str(key), "entry_before": had.name if had else None, "first_call_s": first_s,
           "second_call_s": second_s, "budget_s": BUDGET_S, "stored": stored.name if stored else None,
           "max_error": err, "tolerance": tol, "log": list(lines)}
    if again and stored is not None:
        rule = families.default_spec(key, dev.smem_budget)
        ms = _interleaved({"rule": lambda: flashgen.attention(q, k, v, causal=True, spec=rule),
                           "stored": lambda: flashgen.attention(q, k, v, causal=True, spec=stored)})
        doc.update({"rule": rule.name, "rule_ms": ms["rule"], "stored_ms": ms["stored"],
                    "gain_over_rule": ms["rule"] / ms["stored"]})
    _dump(os.path.join(out, "again.json" if again else "first.json"), doc)
    return 0 if err <= tol and stored is not None else 1


# -- the orchestrator --------------------------------------------------------------------------------
def _run(name, cmd, env, timeout, log_path):
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        try:
            code = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout,
                                  cwd=ROOT).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    return f"{name}: exit {code} in {time.monotonic() - t0:.0f} s (limit {timeout} s)"


def _figures(out) -> list:
    lines = []
    try:
        s = json.load(open(os.path.join(out, "validate", "validation.json")))["summary"]
        lines.append("validate: " + json.dumps(s, default=str))
    except (OSError, ValueError, KeyError) as exc:
        lines.append(f"validate: no result ({exc})")
    try:
        doc = json.load(open(os.path.join(out, "record", "record.json")))
        lines.append(f"record: {len(doc['recorded'])} keys recorded, {len(doc['keys'])} tuned, tune {doc['tune_s']:.0f} s "
                     f"(exit {doc['tune_exit']})")
        lines.extend(f"  not tuned: {line}" for line in doc.get("not_tuned", []))
        lines += [f"  {r['key']} {r['shape']}: {r['before']} {r['before_ms']:.3f} ms -> {r['after']} "
                  f"{r['after_ms']:.3f} ms ({r['gain']:.3f}x; the same spec again: {r.get('control', 0):.3f}x)"
                  for r in doc["keys"]]
        spread = doc.get("model_spread", {})
        lines += [f"  model {name}: {doc['model_ms'][name + ' untuned']:.2f} ms untuned, "
                  f"{doc['model_ms'][name + ' tuned']:.2f} ms tuned ({gain:.3f}x; rounds spread "
                  f"{100 * spread.get(name + ' untuned', 0):.1f} % / {100 * spread.get(name + ' tuned', 0):.1f} %)"
                  for name, gain in doc.get("model_gain", {}).items()]
    except (OSError, ValueError, KeyError) as exc:
        lines.append(f"record: no result ({exc})")
    for name in ("first", "again"):
        try:
            lines.append(f"autotune {name}: " + json.dumps({k: v for k, v in json.load(
                open(os.path.join(out, "autotune", f"{name}.json"))).items() if k != "log"}, default=str))
        except (OSError, ValueError) as exc:
            lines.append(f"autotune {name}: no result ({exc})")
    return lines


def main() -> int:
    if len(sys.argv) >= 4 and sys.argv[1] == "--step":
        step, out = sys.argv[2], sys.argv[3]
        os.makedirs(out, exist_ok=True)
        if step == "record":
            return step_record(out)
        if step in ("autotune-first", "autotune-again"):
            return step_autotune(out, step == "autotune-again")
        print(f"unknown step {step!r}", file=sys.stderr)
        return 2
    out = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "bench-results", "tuner-check"))
    os.makedirs(out, exist_ok=True)
    home = tempfile.mkdtemp(prefix="flashgen-tuner-check-")
    env = {**os.environ, "FLASHGEN_HOME": home, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "PYTHONUNBUFFERED": "1"}
    py = sys.executable
    me = os.path.abspath(__file__)
    status = [
        _run("validate", [py, "-m", "flashgen.cli", "tune", *VALIDATE, "--out", os.path.join(out, "validate")],
             env, 100, os.path.join(out, "validate.log")),
        _run("record", [py, me, "--step", "record", os.path.join(out, "record")], env, 240,
             os.path.join(out, "record.log")),
        _run("autotune first", [py, me, "--step", "autotune-first", os.path.join(out, "autotune")],
             {**env, "FLASHGEN_AUTOTUNE": "1", "FLASHGEN_AUTOTUNE_BUDGET": str(BUDGET_S)}, 40,
             os.path.join(out, "autotune-first.log")),
        _run("autotune again", [py, me, "--step", "autotune-again", os.path.join(out, "autotune")],
             {**env, "FLASHGEN_AUTOTUNE": "1", "FLASHGEN_AUTOTUNE_BUDGET": str(BUDGET_S)}, 20,
             os.path.join(out, "autotune-again.log")),
    ]
    text = "\n".join(status + _figures(out)) + "\n"
    with open(os.path.join(out, "summary.txt"), "w") as fh:
        fh.write(text)
    print(text, end="")
    for name in ("validate.log", "record.log", "autotune-first.log", "autotune-again.log"):
        try:
            tail = open(os.path.join(out, name)).read().splitlines()[-15:]
        except OSError:
            continue
        print(f"--- {name} (tail)\n" + "\n".join(tail))
    return 0


if __name__ == "__main__":
    sys.exit(main())
