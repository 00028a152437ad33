"""Convert a tiny random Hugging Face Llama to GQLA, report the error per rank, and decode on both paths.

Builds a ``LlamaForCausalLM`` from a config (random weights, GQA with 2 KV heads, nothing downloaded), converts
it with ``convert_llama`` at several latent ranks ``r`` and rope widths ``d_R`` (with and without calibration on
the prompt's tokens), prints each conversion's logit error against the original model (float64 reference), then
generates greedily from the full-rank conversion through the absorb path (``mla_decode`` over the latent cache)
and the grouped path (``gqa_decode``), checking both give the original model's tokens. Exits 1 if a check fails.
Without CUDA it runs under the Triton CPU interpreter. Needs ``transformers`` (``pip install -e ".[hf]"``).

    python examples/convert_llama.py

Its output on the CPU (logit error of the converted model against the original, float64 reference; the exact
conversion's 2.4e-07 is float32 rounding):

| d_R | r | logit rel. error | calibrated on the prompt |
|---|---|---|---|
| 0 | 16 | 4.62e-01 | 1.82e-01 |
| 0 | 32 | 2.70e-01 | 7.81e-03 |
| 0 | 48 | 8.63e-02 | 7.81e-03 |
| 0 | 64 | 7.84e-03 | 7.84e-03 |
| 16 | 16 | 5.21e-01 | 2.17e-01 |
| 16 | 32 | 2.57e-01 | 4.98e-03 |
| 16 | 48 | 4.43e-03 | 4.97e-03 |
| 16 | 64 | 4.43e-03 | 4.97e-03 |
| 32 | 16 | 3.64e-01 | 1.41e-01 |
| 32 | 32 | 2.42e-07 | 2.35e-07 |
| 32 | 48 | 2.42e-07 | 2.35e-07 |
| 32 | 64 | 2.42e-07 | 2.36e-07 |

Random weights spread their energy evenly, so these errors fall slower with rank than a trained model's
(whose K/V spectra decay fast); at ``d_R = g·d = 32`` (every rotary component kept) the values' rank
``g·d_v = 32`` already suffices, since the folded keys are empty.
"""

from __future__ import annotations

import copy
import os
import sys

import torch

if not torch.cuda.is_available():  # must be set before gqla_triton (and triton) are imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import transformers  # noqa: E402

from gqla_triton.convert import convert_llama, set_decode_path  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def float64_logits(model, ids):
    """The original model in float64 with float64 rotary angles: the reference."""
    m = copy.deepcopy(model).to("cpu", torch.float64)
    rot = m.model.rotary_emb

    def forward(x, position_ids):
        ang = position_ids[..., None].double() * rot.inv_freq.double()
        emb = torch.cat([ang, ang], -1)
        return emb.cos() * rot.attention_scaling, emb.sin() * rot.attention_scaling

    rot.forward = forward
    with torch.no_grad():
        return m(ids.cpu()).logits


def main() -> int:
    torch.manual_seed(0)
    g, d = 2, 16
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=g, head_dim=d,
                                   max_position_embeddings=256, rope_parameters={"rope_type": "default",
                                                                                 "rope_theta": 500.0})
    model = transformers.LlamaForCausalLM(cfg).eval().to(DEV)
    ids = torch.randint(0, cfg.vocab_size, (2, 16), device=DEV)
    ref = float64_logits(model, ids)
    full_rope, full_rank = g * d, 2 * g * d
    print(f"Llama: h 4, g {g}, d {d}; exact conversion at d_R = g·d = {full_rope}, r = 2·g·d = {full_rank}")
    print("| d_R | r | logit rel. error | calibrated on the prompt |")
    print("|---|---|---|---|")
    ok = True
    for rope_dim in (0, full_rope // 2, full_rope):
        for kv_rank in (full_rank // 4, full_rank // 2, 3 * full_rank // 4, full_rank):
            errs = []
            for calib in (None, ids):
                conv = convert_llama(copy.deepcopy(model), kv_rank=kv_rank, rope_dim=rope_dim, calib_input_ids=calib,
                                     impl="reference")
                with torch.no_grad():
                    out = conv(ids).logits.double().cpu()
                errs.append(((out - ref).norm() / ref.norm()).item())
            print(f"| {rope_dim} | {kv_rank} | {errs[0]:.2e} | {errs[1]:.2e} |")
    exact = errs[0]
    ok &= exact < 1e-5
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids))
    with torch.no_grad():
        want = model.generate(ids, **kw)
        conv = convert_llama(copy.deepcopy(model), kv_rank=full_rank, rope_dim=full_rope, max_seqlen=64,
                             page_size=16)
        for path in ("absorb", "grouped"):
            set_decode_path(conv, path)
            got = conv.generate(ids, **kw)
            same = torch.equal(got, want)
            ok &= same
            print(f"{path:8s} decode: {got[0, ids.shape[1]:].tolist()} {'== original' if same else '!= original'}")
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
