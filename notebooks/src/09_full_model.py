# %% [markdown]
# # 09 · The full Kimi K2, with probes
#
# This notebook is meant for a GPU node with the real weights. What it needs:
#
# * the checkpoint: `moonshotai/Kimi-K2-Instruct` from the Hugging Face Hub (61 shards, about 959 GiB of FP8
#   weights; fetched into the Hub cache on first use, `HF_HUB_OFFLINE=1` then reads the cache) or a local folder
#   in the release layout;
# * memory for it: about 1.03 TB of GPU memory with the weights resident (eight 141 GB GPUs,
#   `K2LAB_DEVICE_MAP=auto`; see [08 scale](08_scale.ipynb)), or less with
#   `K2LAB_EXPERT_BUDGET_GIB=...` (routed experts streamed from disk; slow) and/or `K2LAB_NUM_LAYERS=...` (a
#   prefix of the blocks);
# * the variables set before Jupyter starts, for example
#
#       K2LAB_MODEL=moonshotai/Kimi-K2-Instruct K2LAB_DEVICE_MAP=auto jupyter lab notebooks/
#
# Anywhere else (no variables, no GPU, no weights) the parameter cell falls back to K2-nano and says why, and every
# cell below runs the same code on it. Nothing here is K2-nano specific.

# %% tags=["parameters"]
from k2lab import lab

lab.setup_notebook()
settings = lab.LabSettings.from_env()
model, tok, about = lab.load_model(settings, fallback_to_nano=True)
if settings.is_nano:
    about += " -- set K2LAB_MODEL to run the real K2 (see above)"
print(about)

# %% [markdown]
# ## A real prompt
#
# A chat turn, laid out by K2's chat template (see [01 tokens](01_tokens.ipynb)):

# %%
import torch

question = "Write a Python function that checks whether a string is a palindrome."
messages = [{"role": "user", "content": question}]
ids = torch.tensor([tok.apply_chat_template(messages)])  # [B=1, T], ends with the assistant's header
tokens = [tok.id_to_piece(i) for i in ids[0].tolist()]
print(f"{ids.shape[1]} tokens; the last ones: {tokens[-6:]}")

# %% [markdown]
# One forward pass records the router probes and the residual stream. Recorded tensors are moved to the CPU
# (`device="cpu"`), which also gathers them from several GPUs.

# %%
from k2lab import routing

wanted = lambda name: ".mlp.gate." in name or name.endswith("hook_resid_post")
logits, cache = model.run_with_cache(ids, names=wanted, device="cpu")
tr = routing.RoutingTrace.from_cache(cache)  # [L_moe, B, T, ...]
print(f"{len(tr.layers)} MoE layers, top-{tr.indices.shape[-1]} of {tr.scores.shape[-1]} experts")

# %% [markdown]
# ## The routing heatmap
#
# Pick a layer: each row is a token of the prompt, each coloured cell an expert it used, coloured by its weight.
# Look for columns that light up for the template's tokens (the `<|im_...|>` markers, role names) or for runs of
# similar words.

# %% tags=["nbval-ignore-output"]
from k2lab import viz

viz.widgets.routing_explorer(tr, tokens)

# %% [markdown]
# Over the whole prompt, how evenly were the experts used, layer by layer? (One prompt is a small sample: expect
# many idle experts.)

# %% tags=["nbval-ignore-output"]
counts = routing.expert_counts(tr)  # [L_moe, E]
viz.load_figure(routing.relative_load(counts), tr.layers, title="Expert load on this prompt")

# %% [markdown]
# And where did the correction bias change a token's experts?

# %% tags=["nbval-ignore-output"]
viz.bias_flip_figure(tr.bias_flips[:, 0].float().mean(-1), tr.layers)

# %% [markdown]
# ## The next token, layer by layer
#
# The logit lens at the last position (the assistant's turn is about to begin):

# %%
lens = cache.logit_lens(pos=-1)[:, 0]  # [L, V]
top = lens.softmax(-1).max(-1)
for layer, (p, i) in enumerate(zip(top.values.tolist(), top.indices.tolist(), strict=True)):
    if layer % max(1, len(lens) // 12) == 0 or layer == len(lens) - 1:
        print(f"layer {layer:>2}: {tok.id_to_piece(i)!r:<16} p = {p:.2f}")

# %% [markdown]
# ## The answer
#
# Greedy decoding through the latent cache:

# %%
import k2lab

out = k2lab.generate(model, ids, max_new_tokens=40)
print(tok.decode(out[0, ids.shape[1]:]))
