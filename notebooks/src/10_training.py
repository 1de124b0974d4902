# %% [markdown]
# # 10 · How K2-nano was trained
#
# K2-nano was trained with Kimi K2's recipe, scaled down (`python -m k2lab.training --preset nano`; the recipe's
# pieces are small functions in `k2lab.optim`):
#
# * **MuonClip**: the Muon optimizer for every hidden matrix (AdamW for the embedding, the head and the norms),
#   plus **[QK-Clip](GLOSSARY.md#qk-clip)**, which rescales a head's query and key weights whenever its largest
#   attention logit exceeds a threshold τ. The K2 report sets τ = 100; K2-nano uses τ = 30, so that a short run
#   on a small model clips at all;
# * **balancing by the correction bias**, with DeepSeek-V3's published rule: after every step each router's bias
#   moves by ±u towards an even load, and K2-nano adds no auxiliary loss. The K2 report does not describe how
#   K2's own bias was updated; K2's released config carries `aux_loss_alpha: 0.001` and `seq_aux: true`, the
#   settings of the small sequence-wise balance loss that DeepSeek-V3 uses beside its bias rule. So this part is
#   DeepSeek-V3's recipe, which K2 may or may not follow exactly;
# * a **warmup-stable-decay** learning rate.
#
# Every step logged its loss, each head's largest attention logit and each MoE layer's expert counts
# (`assets/nano/training_log.json`). This notebook reads that log, then shows two of the rules acting on the
# model itself.

# %% tags=["parameters"]
import json
from pathlib import Path

from k2lab import lab
from k2lab.lab.nano import NANO_DIR

lab.setup_notebook()
settings = lab.LabSettings.from_env()
if not (Path(settings.model) / "training_log.json").is_file():
    settings = lab.LabSettings()  # the log, and this notebook, are K2-nano's
folder = NANO_DIR if settings.is_nano else Path(settings.model)
log = json.loads((folder / "training_log.json").read_text())
model, tok, about = lab.load_model(settings)
print(about)

# %% [markdown]
# ## The run
#
# Two units appear below. The training loss is a cross-entropy in **[nats](GLOSSARY.md#nats)** per token: the
# mean of −ln p(next token), natural logarithms (1 nat = 1.443 bits). Held-out text is scored in
# **[bits per byte](GLOSSARY.md#bits-per-byte)**: the summed −log₂ p of every token of the text, divided by the
# text's UTF-8 bytes. Per byte, not per token, so it does not depend on the tokenizer: a model with longer tokens
# does not look better merely for taking fewer, larger steps. (A model that knew nothing would pay 8 bits per
# byte; the token-unigram baseline, which knows only how frequent each token is, pays the figure printed below.)

# %%
run = log["train"]
steps = [s["step"] for s in log["steps"]]
print(f"{len(steps)} steps of {run['batch_size']} x {run['seq_len']} tokens, peak lr {run['lr']}, "
      f"QK-Clip tau {run['qk_clip_tau']}, bias step {run['bias_step']}; {log['seconds'] / 60:.1f} min")
print(f"held-out code: {log['evals'][-1]['heldout_code_bpb']:.3f} bits per byte "
      f"(token-unigram baseline {log['unigram_heldout_code_bpb']:.3f})")

# %% tags=["nbval-ignore-output"]
from k2lab import viz

viz.loss_figure(steps, [s["loss"] for s in log["steps"]], [e["step"] for e in log["evals"]],
                [e["heldout_code_bpb"] for e in log["evals"]], log["unigram_heldout_code_bpb"])

# %% [markdown]
# The learning rate warmed up, stayed flat, then decayed linearly to zero over the last part of the run (WSD).
# The balancing step u (below) decays with it:

# %% tags=["nbval-ignore-output"]
viz.lines_figure(steps, {"learning rate": {"lr": [s["lr"] for s in log["steps"]]},
                         "bias step u": {"u": [s["bias_step"] for s in log["steps"]]}}, "step",
                 title="Warmup-stable-decay schedule", height=320)

# %% [markdown]
# ## QK-Clip
#
# Attention logits can grow without bound when a query and a key weight grow together; a few runaway heads can
# destabilise training. After each step, QK-Clip looks at each head's largest pre-softmax logit S_max (read from
# the `hook_max_logit` probe during the forward: the maximum of the masked `hook_attn_scores`, which the probe
# computes beside the fused attention kernel, so training never materialises a softmax). If S_max > τ, with
# γ = τ / S_max it scales that head's
#
# * content query and key weights (W_UQ^nope, W_UK rows) by √γ, so q_nope · k_nope shrinks by γ;
# * rotary query weights by γ (the rotary key is shared by all heads, so it is left alone), so q_pe · k_pe
#   shrinks by γ too.
#
# The figure shows every head's S_max over training against τ, and how many heads were clipped at each step.

# %%
import torch

max_logits = torch.tensor([s["max_logits"] for s in log["steps"]])  # [S, L, H]
clipped = torch.tensor([s["clipped_heads"] for s in log["steps"]])  # [S]
print(f"steps with at least one clipped head: {int((clipped > 0).sum())} of {len(steps)}; "
      f"largest logit seen {max_logits.max().item():.1f} (tau {run['qk_clip_tau']})")

# %% tags=["nbval-ignore-output"]
viz.qk_clip_figure(steps, max_logits, run["qk_clip_tau"])  # the heatmap thins itself; the count uses every step

# %% [markdown]
# The rule itself, on a copy of the trained model: clip the heads of the last layer to half their largest logit.
# Both terms of every score in those heads shrink by the same γ, so their new largest logits are exactly τ. (Only
# one layer, so that the layer's input stays the same: clipping earlier layers would change it.)

# %%
# NBVAL_CHECK_OUTPUT
import copy

from k2lab.training import corpus
from k2lab.training.optim import qk_clip

text = tok.encode(corpus.corpus_text("heldout", "prose"), allow_special=False)[: 4 * 65]
batch = torch.tensor(text, device=model.device).view(4, 65)  # [B, T+1]: inputs and shifted targets


def head_max(m) -> torch.Tensor:
    """[L, H] each head's largest pre-softmax logit on the batch."""
    _, c = m.run_with_cache(batch[:, :-1], names="hook_max_logit")
    return c.stack("hook_max_logit").amax(dim=1)  # [L, B, H] -> over the batch


clipped_model = copy.deepcopy(model)
last = len(model.layers) - 1
before = head_max(clipped_model)  # [L, H]
tau = torch.full_like(before, float("inf"))  # no clipping ...
tau[last] = before[last] / 2  # ... except in the last layer, at half its largest logits
gamma = qk_clip(clipped_model, before, tau)  # [L, H] = min(1, tau / S_max)
after = head_max(clipped_model)
print(f"gamma in layer {last}: {gamma[last].tolist()}; "
      f"elsewhere all 1: {bool((gamma[:last] == 1).all())}")
print("its largest logits after the clip equal tau:", torch.allclose(after[last], tau[last], rtol=1e-4))

# %% [markdown]
# ## Balancing the experts: DeepSeek-V3's bias rule
#
# After every step, each MoE layer's bias moves by u towards balance (DeepSeek-V3's rule, which K2-nano follows):
#
# $$b_e \leftarrow b_e + u \cdot \operatorname{sign}(\bar c - c_e),$$
#
# up for experts that got fewer tokens than the mean, down for busier ones. u stays at `bias_step` and then
# decays to zero with the learning rate, so routing settles while the weights anneal (DeepSeek-V3 also stops
# its bias updates for the end of training). The log keeps every step's u and counts c_e, so the whole history
# of the bias can be replayed from it, and it must end at the bias in the checkpoint:

# %%
# NBVAL_CHECK_OUTPUT
from k2lab import routing

counts = torch.tensor([s["expert_load"] for s in log["steps"]], dtype=torch.float32)  # [S, L_moe, E]
u = torch.tensor([s["bias_step"] for s in log["steps"]])[:, None, None]  # [S, 1, 1]
steps_taken = u * torch.sign(counts.mean(-1, keepdim=True) - counts)  # [S, L_moe, E]
bias = steps_taken.cumsum(0)  # [S, L_moe, E]: the bias after each step
layers = routing.moe_layers(model)  # indices of the MoE blocks
final = torch.stack([model.layers[i].mlp.gate.e_score_correction_bias for i in layers]).cpu()  # [L_moe, E] as the log
print("replayed bias equals the checkpoint's:", torch.allclose(bias[-1], final, atol=1e-4))

# %% [markdown]
# Load balance over training (MaxVio per layer, 0 = even), and one layer's bias and relative load per expert:

# %% tags=["nbval-ignore-output"]
max_vio = routing.max_violation(counts)  # [S, L_moe]
per_layer = {f"layer {i}": max_vio[:, j] for j, i in enumerate(layers)}
viz.lines_figure(steps, {"MaxVio per step": per_layer}, "step",
                 title="Expert load balance during training (MaxVio, 0 = perfectly even)")

# %% tags=["nbval-ignore-output"]
every = max(1, len(steps) // 200)  # heatmaps of every n-th step keep the stored notebook small
j = len(layers) - 1
viz.expert_time_figure(steps[::every], bias[::every, j], "bias", zmid=0.0,
                       title=f"Layer {layers[j]}: correction bias per expert")

# %% tags=["nbval-ignore-output"]
viz.expert_time_figure(steps[::every], routing.relative_load(counts[::every, j]), "load /<br>uniform",
                       log2=True, title=f"Layer {layers[j]}: relative load per expert")

# %% [markdown]
# ## Muon's update on one matrix
#
# For a weight matrix with gradient (or momentum) G = U Σ Vᵀ, Muon steps along U Vᵀ: the same directions, with
# every singular value set to one, so rare directions learn as fast as common ones. Five Newton–Schulz iterations
# approximate U Vᵀ with matrix products only; the result is scaled by 0.2·√max(A, B) so its RMS matches a typical
# AdamW update, and then W ← W (1 − η λ) − η · update.
#
# One real gradient, for the query up-projection of layer 1:

# %%
import torch.nn.functional as F

from k2lab.training.optim import muon_update, newton_schulz

weight = model.layers[1].self_attn.q_b_proj.weight  # [H * (N + R), q_lora_rank]
with torch.enable_grad():
    loss = F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
    grad = torch.autograd.grad(loss, weight)[0]  # [A, B]
sv = lambda m: torch.linalg.svdvals(m.double())
update = muon_update(grad)
print(f"gradient {list(grad.shape)}: singular values from {sv(grad)[0]:.2e} to {sv(grad)[-1]:.2e}")
ns = sv(newton_schulz(grad))  # descending
print(f"Newton-Schulz: singular values from {ns[-1]:.2f} to {ns[0]:.2f}")
print(f"update RMS {update.pow(2).mean().sqrt().item():.3f} (0.2 when U V^T is exact)")

# %% tags=["nbval-ignore-output"]
U, S, Vh = torch.linalg.svd(grad.double(), full_matrices=False)
viz.singular_values_figure({"gradient / its largest singular value": S / S[0],
                            "Newton-Schulz, 5 steps": ns, "U Vᵀ (exact)": sv(U @ Vh)},
                           title="Layer 1 q_b_proj: Muon keeps directions, equalises sizes")

# %% [markdown]
# ## Exercises
#
# **1. Predict, then run.** In the clip demo above, the last layer's heads were clipped to half their largest
# logit, so γ = 0.5. By what factor did the clip scale each head's content query rows (W_UQ^nope), its rotary query
# rows, and its key rows (W_UK)? Predict, then divide `clipped_model`'s weights by `model`'s.
#
# **2. Change a knob.** Clip the last layer at 3/4 of each head's largest logit instead of 1/2. Predict γ and the
# largest logits after the clip, then run `qk_clip` on a fresh copy.

# %%
# your code here

# %% [markdown]
# **3. Write it yourself: the bias update.** One balancing step for every MoE layer: given the bias [L, E], the
# step's expert counts [L, E] and u, return the new bias. Then replay the whole log with your function and compare
# the result with the checkpoint's bias.

# %%
from k2lab.lab import exercises


def my_bias_update(bias: torch.Tensor, counts: torch.Tensor, u: float) -> torch.Tensor:
    """bias, counts [L, E]; u the step -> the new bias [L, E]"""
    raise NotImplementedError


print(exercises.check_bias_update(my_bias_update))

# %% [markdown]
# ## Solutions
#
# **1.** √γ ≈ 0.707 on the content query and key rows (their product shrinks by γ), γ = 0.5 on the rotary query
# rows (the shared rotary key is left alone), so both terms of the score shrink by γ:

# %% tags=["solution"]
cfg = model.config
H, N, R, V = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim


def scaled_by(name: str, rows: int) -> torch.Tensor:
    """[H, rows] the factor each row of the last layer's ``name`` weight was multiplied by (median over its inputs;
    FP8-stored weights hold exact zeros, which say nothing)."""
    before_w = getattr(model.layers[last].self_attn, name).weight.view(H, rows, -1)
    after_w = getattr(clipped_model.layers[last].self_attn, name).weight.view(H, rows, -1)
    return (after_w / before_w).nanmedian(-1).values  # 0 / 0 = nan is skipped


q_rows, kv_rows = scaled_by("q_b_proj", N + R), scaled_by("kv_b_proj", N + V)
print(f"head 0: content query rows x {q_rows[0, :N].median().item():.3f}, rotary query rows x "
      f"{q_rows[0, N:].median().item():.3f}, key rows x {kv_rows[0, :N].median().item():.3f}, value rows x "
      f"{kv_rows[0, N:].median().item():.3f}")

# %% [markdown]
# **2.** γ = 0.75 in every head of the layer, and the largest logits become exactly τ:

# %% tags=["solution"]
three_quarters = copy.deepcopy(model)
tau_34 = torch.full_like(before, float("inf"))
tau_34[last] = before[last] * 0.75
gamma_34 = qk_clip(three_quarters, before, tau_34)
print(f"gamma {[round(g, 3) for g in gamma_34[last].tolist()]}; largest logits after "
      f"{[round(x, 2) for x in head_max(three_quarters)[last].tolist()]} = tau {[round(x, 2) for x in tau_34[last].tolist()]}")

# %% [markdown]
# **3.** One line; the replay then reproduces the checkpoint's bias:

# %% tags=["solution"]
def my_bias_update(bias: torch.Tensor, counts: torch.Tensor, u: float) -> torch.Tensor:
    return bias + u * torch.sign(counts.mean(-1, keepdim=True) - counts)


assert exercises.check_bias_update(my_bias_update)
print(exercises.check_bias_update(my_bias_update))
replayed = torch.zeros_like(final)
for step_counts, step_u in zip(counts, u.flatten().tolist(), strict=True):
    replayed = my_bias_update(replayed, step_counts, step_u)
print("replayed with my_bias_update equals the checkpoint's bias:", torch.allclose(replayed, final, atol=1e-4))
