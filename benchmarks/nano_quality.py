"""K2-nano's quality figures: held-out bits per byte against the unigram baseline, greedy completions of code
prompts, and routing specialisation (load balance, code against prose).

    python -m benchmarks.nano_quality
"""

from __future__ import annotations

import json

import torch

import k2lab
from k2lab import routing
from k2lab.lab.nano import NANO_DIR
from k2lab.training import corpus
from k2lab.training.train import bits_per_byte, token_stream, unigram_bits_per_byte

PROMPTS = ["def __init__(self", "import ", "for i in range(", "class Parser:\n    def "]


@torch.no_grad()
def main() -> None:
    torch.set_num_threads(1)
    model, tok = k2lab.load_nano()
    seq_len = 256
    test_suite = json.loads((NANO_DIR / "training_log.json").read_text()).get("test_suite_rows", 0) > 0
    train = token_stream(tok, "train", test_suite=test_suite)  # the split the bundled run trained on
    for kind in ("code", "prose"):
        heldout = token_stream(tok, "heldout", kind)
        print(f"held-out {kind}: {bits_per_byte(model, tok, heldout, seq_len):.3f} bits/byte "
              f"(unigram baseline {unigram_bits_per_byte(train, tok, heldout, seq_len):.3f}; "
              f"{len(heldout):,} tokens)")

    print("\ngreedy completions (with token healing):")
    for prompt in PROMPTS:
        out = k2lab.generate(model, torch.tensor([tok.encode(prompt)]), max_new_tokens=40, tokenizer=tok,
                             token_healing=True)
        print(f"--- {prompt!r}\n{tok.decode(out[0].tolist())}")

    # Routing on held-out text: 8 windows of code and 8 of prose (never trained on).
    traces = {}
    for kind in ("code", "prose"):
        ids = token_stream(tok, "heldout", kind)[: 8 * seq_len].view(8, seq_len).long()
        traces[kind] = routing.trace(model, ids)
    counts = routing.expert_counts(traces["code"]) + routing.expert_counts(traces["prose"])  # [L_moe, E]
    layers = traces["code"].layers
    print("\nMaxVio per MoE layer (0 = perfectly balanced):",
          " ".join(f"L{layer} {v:.2f}" for layer, v in zip(layers, routing.max_violation(counts).tolist(),
                                                             strict=True)))
    code = routing.domain_specialization(traces["code"])
    prose = routing.domain_specialization(traces["prose"])
    uniform = model.config.num_experts_per_tok / model.config.n_routed_experts
    gap = (code - prose).abs()  # [L_moe, E]
    print(f"code vs prose: share of tokens per expert, uniform {uniform:.3f}; per layer the largest gap "
          f"|code - prose| and the total variation 0.5 * sum_e |code - prose| / k:")
    for j, layer in enumerate(layers):
        e = int(gap[j].argmax())
        print(f"  L{layer}: expert {e} takes {code[j, e]:.2f} of code tokens vs {prose[j, e]:.2f} of prose; "
              f"TV {0.5 * gap[j].sum() / model.config.num_experts_per_tok:.2f}")
    print(f"training split: {sum(1 for _ in corpus.documents('train', test_suite=test_suite))} documents, "
          f"{len(train):,} tokens (test suite included: {test_suite})")


if __name__ == "__main__":
    main()
