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
# cell below runs the same code on it. Nothing in the code is K2-nano specific.
#
# **What the stored outputs show, and what they do not.** The outputs saved in this notebook are K2-nano's, because
# the lab is built on a CPU. K2-nano was trained on Python source and prose, never on a chat turn: the special
# tokens of the chat template never appeared in its training text. So its "answer" below is not an answer, and its
# logit lens at the assistant's turn predicts noise. What does carry over to the real K2, unchanged: the probe
# names and the shapes they record, the way a chat prompt is laid out and routed token by token, how to read the
# routing heatmap, the load and the bias flips, and the logit lens read at the turn's first position. A real-shape
# MoE layer with experts streamed from disk runs in [08](08_scale.ipynb) on a CPU; the whole K2 needs the GPU node.

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
# A chat turn, laid out by K2's [chat template](GLOSSARY.md#chat-template) (see [01 tokens](01_tokens.ipynb)):

# %%
import torch

question = "Write a Python function that checks whether a string is a palindrome."
messages = [{"role": "user", "content": question}]
ids = torch.tensor([tok.apply_chat_template(messages)], device=model.device)  # [B=1, T], ends with the assistant's header
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
# Where do the template's tokens go? The chat markers are the same in every conversation, and attention is
# causal, so the markers before the user's text are routed the same whatever the question. The last MoE layer's
# experts for each special token, against those of the question's words:

# %%
specials = set(tok.special_tokens.values())
last = tr.layers[-1]
for t, token_id in enumerate(ids[0].tolist()):
    if token_id in specials or t == ids.shape[1] - 1:
        print(f"position {t:>2} {tokens[t]!r:<18} experts {tr.indices[tr.row(last), 0, t].tolist()}")
text_positions = [t for t, i in enumerate(ids[0].tolist()) if i not in specials]
print(f"{len(text_positions)} ordinary tokens use {len(set(tr.indices[tr.row(last), 0, text_positions].flatten().tolist()))} "
      f"distinct experts in layer {last}")

# %% [markdown]
# In K2-nano the markers share a few experts (the same three or four recur): their embeddings were never trained,
# so they look alike to the router. On the real K2, trained on many chat turns, the same table shows which experts
# serve the template.
#
# Over the whole prompt, how evenly were the experts used, layer by layer? (One prompt is a small sample: expect
# many idle experts, drawn in grey.)

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

# %% [markdown]
# On the real K2 this is the start of an answer. From K2-nano it is Python-flavoured noise that soon repeats
# itself: a model that never saw an assistant's turn continues it with the only text it knows, and greedy
# decoding in a small model falls into loops ([00](00_tour.ipynb)).
#
# ## Exercises
#
# **1. Predict, then run.** Change the question (keep it one user message) and trace the routing again. For which
# positions can the experts change, and for which can they not? Predict from the causal mask, then compare the
# two traces position by position.
#
# **2. Change a knob.** Give the conversation your own system message (`{"role": "system", "content": ...}` first)
# and count the tokens: how many does K2's default system prompt take?

# %%
# your code here

# %% [markdown]
# **3. Write it yourself: the logit lens.** From one layer's residual stream, the logits the model would give if
# it stopped there. Then apply it to every layer's `hook_resid_post` at the last position and compare with
# `cache.logit_lens(pos=-1)`.

# %%
from k2lab.lab import exercises


def my_logit_lens(resid: torch.Tensor, norm, head) -> torch.Tensor:
    """resid [T, D]; norm, head: the model's final norm and lm_head -> logits [T, V] (float32)"""
    raise NotImplementedError


print(exercises.check_logit_lens(my_logit_lens))

# %% [markdown]
# ## Solutions
#
# **1.** Every position before the first token that differs routes identically (it cannot see the question);
# from there on, anything may change.

# %% tags=["solution"]
other = torch.tensor([tok.apply_chat_template([{"role": "user", "content": "Sort a list of numbers in Python."}])],
                     device=model.device)
tr_other = routing.trace(model, other)
first = next(t for t, (a, b) in enumerate(zip(ids[0].tolist(), other[0].tolist(), strict=False)) if a != b)
same = [torch.equal(tr.indices[:, 0, t], tr_other.indices[:, 0, t].to(tr.indices.device))  # tr was gathered to the CPU
        for t in range(min(ids.shape[1], other.shape[1]))]
print(f"first differing token at position {first}; routing identical at positions 0..{first - 1}: {all(same[:first])}; "
      f"identical afterwards at {sum(same[first:])} of {len(same) - first} shared positions")

# %% [markdown]
# **2.** The default system message ("You are Kimi, an AI assistant created by Moonshot AI.") is added only when
# none is given. With K2-nano's tokenizer it takes 26 of the prompt's 52 tokens: its turn runs from `<|im_system|>`
# to its `<|im_end|>`, and 22 of those tokens are the message's text. With "Be brief." the system turn is 10
# tokens and the whole prompt 36. These counts come from K2-nano's tokenizer; with `K2LAB_MODEL` set, the cell
# prints those of K2's own.

# %% tags=["solution"]
from k2lab.tokenizer.chat import DEFAULT_SYSTEM_PROMPT

own = [{"role": "system", "content": "Be brief."}, *messages]
with_own = tok.apply_chat_template(own)
user_turn = tok.special_tokens["<|im_user|>"]  # each system turn ends where the user's turn begins
print(f"the default system turn: {ids[0].tolist().index(user_turn)} of the prompt's {ids.shape[1]} tokens, "
      f"{len(tok.encode(DEFAULT_SYSTEM_PROMPT))} of them its text")
print(f"with 'Be brief.': a system turn of {with_own.index(user_turn)} tokens, {len(with_own)} in all")

# %% [markdown]
# **3.** The final norm, then the head, in float32:

# %% tags=["solution"]
def my_logit_lens(resid: torch.Tensor, norm, head) -> torch.Tensor:
    return head(norm(resid)).float()


assert exercises.check_logit_lens(my_logit_lens)
print(exercises.check_logit_lens(my_logit_lens))
resid = cache.stack("hook_resid_post")[:, 0, -1].to(model.device, model.dtype)  # [L, D]
mine = my_logit_lens(resid, model.norm, model.lm_head).cpu()
print("equal to cache.logit_lens(pos=-1):", torch.allclose(mine, lens, atol=1e-4))
