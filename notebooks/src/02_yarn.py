# %% [markdown]
# # 02 · Positions: RoPE and YaRN
#
# Attention by itself does not know where tokens are: shuffle the keys and values together and every query's output
# stays the same. K2 tells attention about order with **rotary position embeddings** ([RoPE](GLOSSARY.md#rope)): the
# query and key vectors are *turned* by an angle that grows with their position, so that their dot product depends
# on how far apart they are.
#
# In K2 only part of each head is turned: the **rotary part**, R = 64 of the 192 query-key features
# (`qk_rope_head_dim` in the released `config.json`; notebook [03](03_mla.ipynb) explains why MLA splits them). Read
# the 64 features as 32 pairs. At position p, pair i is turned by the angle p·θ_i, with
#
# $$\theta_i = \text{base}^{-2i/R}, \qquad \text{base} = 50{,}000 \ (\texttt{rope\_theta}).$$
#
# Pair 0 spins fast (one radian per position); pair 31 very slowly. The number of positions for one full turn of
# pair i is its **wavelength** λ_i = 2π/θ_i.
#
# K2 was pretrained on 4,096-token sequences, then trained on 60 billion tokens at 32K, and stretched to 128K
# (131,072 positions) with **YaRN** (the K2 report, §2.5; `rope_scaling` in the config: factor 32 over
# `original_max_position_embeddings` 4,096). This notebook builds that stretch step by step, from plain RoPE through
# the two ideas YaRN combines, and you write the rotation and YaRN's frequencies yourself. It loads no weights.

# %%
import math

import torch

from k2lab import K2Config, lab
from k2lab.lab import exercises
from k2lab.model import rope

lab.setup_notebook()
k2 = K2Config.kimi_k2()
nano = K2Config.nano()
plain = k2.replace(rope_type=None)  # the same RoPE without YaRN
theta = rope.inverse_frequencies(plain)  # [R/2] radians per position, plain RoPE
wavelength = 2 * math.pi / theta  # [R/2] positions per turn

# %% [markdown]
# ## The rotation
#
# Write each pair as two numbers (a, b). Turning it by the angle φ is the 2-D rotation
#
# $$\begin{pmatrix} a' \\ b' \end{pmatrix} =
#   \begin{pmatrix} \cos\phi & -\sin\phi \\ \sin\phi & \cos\phi \end{pmatrix}
#   \begin{pmatrix} a \\ b \end{pmatrix}, \qquad \phi = p\,\theta_i .$$
#
# Which features form a pair is a layout choice. K2's checkpoint stores each pair as neighbours (x_0, x_1),
# (x_2, x_3), ...; the released code de-interleaves them first (evens, then odds), after which pair i is
# (x_i, x_{i+R/2}), the "rotate-half" layout. k2lab does the same, and so does this exercise: it rotates the
# rotate-half layout.
#
# ### Exercise 1 ★ · Write it yourself: the rotation
#
# `my_rotate(x, positions, inv_freq)` turns each pair (x_i, x_{i+R/2}) of row t by the angle
# positions[t] × inv_freq[i]. Running the cell checks it (`@lab.mine` calls `exercises.check_rotation`, which compares
# it with k2lab's `apply_rotary` and names the usual slips: the sine's sign, neighbour pairs, the angle divided instead
# of multiplied, every row turned alike) and keeps it in your module, `mine.py`.

# %%
@lab.mine
def my_rotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """x [T, R], positions [T] (integers), inv_freq [R/2] -> [T, R]"""
    raise NotImplementedError

# %% [markdown] tags=["hint"]
# **Hint 1 · the idea**
#
# Every pair needs its own angle, position × frequency: one angle per row and per pair. The pair's two numbers sit
# R/2 apart (the first half holds every pair's first number, the second half every pair's second), and the matrix
# above turns each (a, b) by its angle.

# %% [markdown] tags=["hint"]
# **Hint 2 · the code**
#
# The angles are an outer product, `positions[:, None].float() * inv_freq` ([T, R/2]). Split the features with
# `a, b = x.chunk(2, dim=-1)`. Apply the matrix above to (a, b) and concatenate the two results back along the last
# dimension.

# %% [markdown] tags=["solution"]
# Split the features into the two halves, rotate, concatenate:

# %% tags=["solution"]
# Solution (click to show)
def solution_rotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    angles = positions[:, None].float() * inv_freq  # [T, R/2]
    a, b = x.chunk(2, dim=-1)  # the pairs' first and second numbers
    return torch.cat([a * angles.cos() - b * angles.sin(), a * angles.sin() + b * angles.cos()], dim=-1)


print(exercises.check_rotation(solution_rotate))

# %% [markdown]
# ## Why the dot product sees only the distance
#
# Write pair i of a query as the complex number u = a + ib and the same pair of a key as v. A rotation by φ is a
# multiplication by e^{iφ}, and the pair's share of the dot product is Re(u v̄). With the query at position p and the
# key at position s:
#
# $$\operatorname{Re}\big(u\,e^{ip\theta_i}\;\overline{v\,e^{is\theta_i}}\big)
#   = \operatorname{Re}\big(u\,\bar v\;e^{i(p-s)\theta_i}\big).$$
#
# The positions enter only through p − s. Summing over the pairs, the whole rotary dot product depends on the
# positions only through their distance: RoPE encodes relative position for free, whatever the absolute positions.
# (In matrix form: the rotation matrices satisfy R(pθ)ᵀR(sθ) = R((s − p)θ).) A numeric check with `my_rotate` from
# your module (yours if it passed its check, k2lab's reference otherwise: the cell says which):

# %%
mine = lab.mine.load("my_rotate")

# %%
# NBVAL_CHECK_OUTPUT
q, k = torch.randn(2, nano.qk_rope_head_dim, generator=torch.Generator().manual_seed(0)).chunk(2)  # [1, R] each
nano_freq = rope.inverse_frequencies(nano)


def score(p: int, s: int, inv_freq: torch.Tensor = nano_freq) -> float:
    """The rotary dot product of q at position p and k at position s."""
    return (mine.my_rotate(q, torch.tensor([p]), inv_freq) @ mine.my_rotate(k, torch.tensor([s]), inv_freq).T).item()


print(f"score(10, 7) = {score(10, 7):.4f}   score(1010, 1007) = {score(1010, 1007):.4f}   "
      f"score(10, 3) = {score(10, 3):.4f}")

# %% [markdown]
# Same distance, same score; another distance, another score.
#
# ## Beyond the trained context
#
# Pairs whose wavelength is shorter than 4,096 positions turned many times during pretraining: the model saw every
# angle they can take. Pairs with longer wavelengths never completed one turn, so the model only ever saw a part of
# their circle. Run it past 4,096 positions and those pairs reach angles it never saw:

# %%
# NBVAL_CHECK_OUTPUT
L = k2.original_max_position_embeddings  # 4,096
for i in (0, 1, 10, 19, 20, 25, 31):
    print(f"pair {i:>2}: wavelength {wavelength[i].item():>11,.1f} positions, "
          f"{L / wavelength[i].item():8.3f} turns in {L:,}")

# %% [markdown]
# ### First idea: position interpolation
#
# Chen et al. (2023, "position interpolation") divide every position by the stretch factor s = 32: position 131,072
# then gets the angles position 4,096 had, and no pair leaves the range it was trained on. The cost lands on the fast
# pairs: neighbouring tokens now differ by θ_0/32 = 1/32 of a radian in pair 0 instead of one radian, so the
# fine-grained distinctions the model learned (this token or the next one?) are squeezed 32-fold.
#
# ### Second idea: stretch the slow pairs, not the fast ones
#
# "NTK-aware" scaling (bloc97, 2023, a public post that the YaRN paper builds on) raises the base instead, to
# base·s^{R/(R−2)}, which divides pair i's frequency by s^{2i/(R−2)}: pair 0 is left alone and pair 31 is divided
# by exactly s, with a smooth curve between. The fast pairs keep their resolution. But the pairs in the middle are
# divided by less than s, and some of them had not completed a turn: pair 20 turned 0.75 times in 4,096 positions,
# is divided by only 9.4, and so turns 2.6 times over 131,072 positions, through angles it never saw.
#
# ### YaRN: by parts
#
# YaRN (Peng et al., 2023) decides per pair, by how many turns it made in the original context L:
#
# * pairs that turned more than β_fast times keep their frequency (they saw every angle; interpolating them would
#   only blur them);
# * pairs that turned fewer than β_slow times are divided by the full factor s, so the new context covers no more of
#   their circle than the old one did;
# * a linear ramp γ_i joins the two:
#
# $$\theta'_i = \theta_i\left((1-\gamma_i) + \frac{\gamma_i}{s}\right), \qquad
#   \gamma_i = \operatorname{clamp}\left(\frac{i - \text{low}}{\text{high} - \text{low}}, 0, 1\right).$$
#
# The three rules side by side, as the factor each divides a pair's frequency by, and the turns each pair then makes
# over the new 131,072 positions (against the turns it made in pretraining, printed above):

# %%
# NBVAL_CHECK_OUTPUT
s, R = k2.rope_factor, k2.qk_rope_head_dim
pairs = torch.arange(R // 2, dtype=torch.float64)
divisors = {"interpolation": torch.full_like(pairs, s), "NTK-aware": s ** (2 * pairs / (R - 2)),
            "YaRN": (theta / rope.inverse_frequencies(k2)).double()}
print(f"{'pair':>4} {'turns in 4,096':>15} | " + " | ".join(f"{name:>24}" for name in divisors))
for i in (0, 10, 19, 20, 25, 31):
    turns = [k2.max_position_embeddings / wavelength[i].item() / d[i].item() for d in divisors.values()]
    print(f"{i:>4} {L / wavelength[i].item():>15.3f} | " + " | ".join(
        f"÷{d[i].item():5.1f} -> {t:10.2f} turns" for d, t in zip(divisors.values(), turns, strict=True)))

# %% [markdown]
# Read the rows: interpolation keeps every pair within its trained turns but divides pair 0 too; NTK-aware keeps
# pair 0 whole but sends pairs 20 and 25, which never completed a turn, through 2.58 and 0.27 turns where
# pretraining showed them 0.75 and 0.14; YaRN keeps the pairs that completed a turn (0..19: they saw every angle, so
# more turns show them nothing new) and holds the others to exactly the turns they made in pretraining.

# %% tags=["nbval-ignore-output"]
from k2lab import viz

viz.lines_figure(pairs.tolist(), {"frequency divided by": divisors}, "rotary pair i (fast → slow)", log_y=True,
                 title="Three ways to stretch K2's RoPE 32-fold: what each divides every pair's frequency by")

# %% [markdown]
# The figure shows the same three rules over all 32 pairs (log scale): interpolation flat at 32, NTK-aware a
# straight line in log scale from 1 to 32, YaRN a step at pair 20, which the next section derives.
#
# ## Where the ramp starts and ends: d(β)
#
# Which pair made exactly β turns in the original context L? Pair i made L/λ_i turns, with λ_i = 2π·base^{2i/R}.
# Setting L/λ_i = β and solving for i:
#
# $$\text{base}^{2i/R} = \frac{L}{2\pi\beta} \quad\Longrightarrow\quad
#   d(\beta) = \frac{R\,\ln\!\big(L / (2\pi\beta)\big)}{2\ln \text{base}} .$$
#
# d(β) is fractional; the ramp's ends are whole pairs: low = ⌊d(β_fast)⌋, high = ⌈d(β_slow)⌉. K2 sets
# β_fast = β_slow = 1 (its config; the YaRN paper's defaults are 32 and 1), so both ends come from one turn:

# %%
# NBVAL_CHECK_OUTPUT
d = R * math.log(L / (2 * math.pi * 1.0)) / (2 * math.log(k2.rope_theta))  # beta = 1 turn in L
print(f"d(1) = {d:.3f} (k2lab: {rope.yarn_correction_dim(1.0, R, k2.rope_theta, L):.3f}) "
      f"-> (low, high) = {rope.yarn_correction_range(k2)}")
print(f"pair 19 turns {L / wavelength[19].item():.3f} times in 4,096 positions, pair 20 {L / wavelength[20].item():.3f}")

# %% [markdown]
# So for K2 the "ramp" is a step: pairs 0..19 keep their frequency and pairs 20..31 are divided by 32. What the
# sources leave unsaid: neither the K2 report nor the config explains why β_fast = β_slow = 1 (a hard cut, where
# DeepSeek-V3's config has β_fast = 32 and a real ramp), nor whether the 32K training stage already used YaRN's
# frequencies or plain RoPE.
#
# ## The temperature: why it moved into the softmax scale
#
# Stretching the context also changes attention's statistics: softmax over many more keys is flatter. The YaRN paper
# sharpens it back with a temperature, multiplying every logit by m² with m = 0.1·ln(s) + 1 (a rule found
# empirically in the paper, on Llama models). YaRN's reference code does this by multiplying cos and sin by m: the
# query and the key are each rotated *and* lengthened by m, so their dot product grows by m².
#
# In MLA that trick would miss most of the logit. Only the 64 rotary features are rotated; the other 128 (the
# content part, notebook 03) never touch cos and sin, so scaling cos and sin multiplies only the rotary term by m².
# DeepSeek's code (which K2's release uses) therefore splits the factor in two settings:
#
# * cos and sin are multiplied by mscale(s, `mscale`) / mscale(s, `mscale_all_dim`), with mscale(s, a) = 0.1·a·ln(s) + 1;
# * the softmax scale, usually $1/\sqrt{d}$ with d = 128 + 64 = 192 query-key features, is multiplied by
#   mscale(s, `mscale_all_dim`)², which reaches **all dimensions** of the logit at once.
#
# K2's config sets both to 1.0: the factor on cos and sin is exactly 1, and the whole temperature sits in the softmax
# scale, one number applied to every logit:
#
# $$\text{softmax scale} = 192^{-1/2} \cdot m^2 = 0.0721688 \times 1.3465736^2 = 0.1308608 .$$
#
# A check with random content and rotary parts: lengthening the rotary features by m scales only their term, the
# softmax scale scales the whole logit:

# %%
# NBVAL_CHECK_OUTPUT
m = 0.1 * math.log(k2.rope_factor) + 1
g = torch.Generator().manual_seed(1)
q_nope, k_nope, q_pe, k_pe = (torch.randn(d, generator=g, dtype=torch.float64) for d in (128, 128, 64, 64))
content, rotary = (q_nope @ k_nope).item(), (q_pe @ k_pe).item()
print(f"content {content:.3f}, rotary {rotary:.3f}, sum {content + rotary:.3f}")
print(f"m on cos and sin:     {content + (m * q_pe) @ (m * k_pe):.3f}  (only the rotary term grew)")
print(f"m^2 in softmax scale: {m**2 * (content + rotary):.3f}  (the whole logit, x {m**2:.4f})")
print(f"m = {m:.7f} (config: {k2.yarn_mscale:.7f}); cos/sin factor {rope.cos_sin_scale(k2):.1f}; "
      f"softmax scale {k2.qk_head_dim ** -0.5:.7f} * m^2 = {k2.softmax_scale:.7f}")

# %% [markdown]
# A second reason, our reading of the code rather than anything the sources state: the cache stores the rotated
# k_pe, and the absorbed attention of notebook 03 scores against it directly, so a temperature kept out of cos and
# sin leaves the cached keys unscaled and folds into the one scalar the attention kernel already takes. What the
# sources leave unsaid: neither the K2 report nor DeepSeek's reports explain the two mscale settings, and whether
# 0.1·ln(s) + 1 was tuned again for K2 is not stated.
#
# ### Exercise 2 ★★ · Write it yourself: YaRN's frequencies and softmax scale
#
# `my_yarn(cfg)` returns `(inv_freq [R/2], softmax_scale)` for any config: the correction range from d(β_fast) and
# d(β_slow), the ramp over the pair index, the blended inverse frequencies, and (N + R)^{-1/2}·m² with
# m = 0.1·`mscale_all_dim`·ln(s) + 1. The check runs it on K2's config and on DeepSeek-V3's (base 10,000, factor 40,
# β_fast = 32: a real ramp, where a step-shaped answer or swapped β's show), and names the usual slips (the ramp the
# wrong way round, indexed by dimension instead of pair, not clamped, the range rounded the wrong way, the 2π
# forgotten, m not squared, ...).

# %%
@lab.mine
def my_yarn(cfg: K2Config) -> tuple[torch.Tensor, float]:
    """(inv_freq [R/2], softmax_scale) for cfg's YaRN settings: rope_theta, rope_factor,
    original_max_position_embeddings, beta_fast, beta_slow, mscale_all_dim, qk_head_dim, qk_rope_head_dim."""
    raise NotImplementedError

# %% [markdown] tags=["hint"]
# **Hint 1 · the idea**
#
# Three steps, as derived above. Which pairs are kept and which divided: d(β) says which pair turns β times in the
# original context; round the fast end down and the slow end up, and ramp linearly between them over the pair
# index. Each pair's frequency is then a blend of its own (ramp 0) and its own divided by s (ramp 1). The scale is
# the naive one times m², m from `mscale_all_dim`.

# %% [markdown] tags=["hint"]
# **Hint 2 · the code**
#
# Four lines of arithmetic. `base = 1 / cfg.rope_theta ** (torch.arange(0, R, 2, dtype=torch.float64) / R)`;
# `low = math.floor(d(cfg.beta_fast))`, `high = math.ceil(d(cfg.beta_slow))` (should they ever coincide, widen
# `high` by 0.001 so as not to divide by zero); the ramp
# `((torch.arange(R // 2) - low) / (high - low)).clamp(0, 1)`; blend `base / s * ramp + base * (1 - ramp)`.

# %% [markdown] tags=["solution"]
# d(β) as derived above, the rounded range, the clamped ramp, the blend; and the scale with m squared, since the
# temperature multiplies both the query and the key side:

# %% tags=["solution"]
# Solution (click to show)
def solution_yarn(cfg: K2Config) -> tuple[torch.Tensor, float]:
    R, base_, s_, L_ = cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_factor, cfg.original_max_position_embeddings
    base_freq = 1.0 / base_ ** (torch.arange(0, R, 2, dtype=torch.float64) / R)  # [R/2] plain RoPE

    def d(beta: float) -> float:  # the pair that makes beta turns in the original context
        return R * math.log(L_ / (2 * math.pi * beta)) / (2 * math.log(base_))

    low, high = max(math.floor(d(cfg.beta_fast)), 0), min(math.ceil(d(cfg.beta_slow)), R - 1)
    high = high + 0.001 if high == low else high  # a zero-width ramp would divide by zero
    ramp = ((torch.arange(R // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    m_ = 0.1 * cfg.mscale_all_dim * math.log(s_) + 1
    return base_freq / s_ * ramp + base_freq * (1 - ramp), cfg.qk_head_dim**-0.5 * m_**2


print(exercises.check_yarn_frequencies(solution_yarn))

# %% [markdown]
# ## Your two pieces together
#
# Your frequencies are the model's (the check compared them with `k2lab.model.rope`), and your rotation turns
# vectors with them. K2 against DeepSeek-V3, as the share of each pair's frequency that YaRN divides away (0: kept,
# 1: divided by the full factor), and the relative-position property at K2's far end, with the frequencies of your
# module (yours where they passed their check; the next cell says which):

# %%
mine = lab.mine.load("my_rotate", "my_yarn")

# %%
# NBVAL_CHECK_OUTPUT
v3 = k2.replace(**exercises.DEEPSEEK_V3_ROPE)
for name, cfg in (("K2", k2), ("DeepSeek-V3", v3)):
    base_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, R, 2, dtype=torch.float64) / R)  # plain RoPE
    inv_freq, scale = mine.my_yarn(cfg)
    ramp = ((1 - inv_freq / base_freq) / (1 - 1 / cfg.rope_factor)).clamp(min=0)  # 0 kept, 1 divided by the factor
    print(f"{name:<12} range {rope.yarn_correction_range(cfg)}, scale {scale:.5f}, ramp "
          f"{' '.join(f'{r:.2f}' for r in ramp[8:26].tolist())} (pairs 8..25)")

q64, k64 = torch.randn(2, R, generator=torch.Generator().manual_seed(0), dtype=torch.float64).chunk(2)
inv_freq = mine.my_yarn(k2)[0].double()  # float64: angles near 131,000 radians keep their digits
far = lambda p, s_: (mine.my_rotate(q64, torch.tensor([p]), inv_freq)  # noqa: E731
                     @ mine.my_rotate(k64, torch.tensor([s_]), inv_freq).T)
print(f"K2, my_yarn: score(10, 7) = {far(10, 7).item():.4f}, "
      f"score(131000, 130997) = {far(131_000, 130_997).item():.4f}")

# %% [markdown]
# DeepSeek-V3's β_fast = 32 stops keeping pairs at pair 10 and ramps over pairs 11..22; K2's β_fast = 1 keeps pairs up
# to 19 whole and cuts at once. At positions 131,000 apart the score for distance 3 is the same as at the start.
#
# The figure shows K2's wavelengths before and after: the slow pairs' wavelengths grow 32-fold, past the new
# context, so no slow pair turns further over 131,072 positions than it did over 4,096.

# %% tags=["nbval-ignore-output"]
viz.yarn_figure(rope.inverse_frequencies(plain), rope.inverse_frequencies(k2), rope.yarn_ramp(k2),
                k2.original_max_position_embeddings, k2.max_position_embeddings,
                title="Kimi K2: RoPE wavelengths before and after YaRN (s = 32)")

# %% [markdown]
# ## Explorer
#
# Move the sliders to see how the factor and the two β set which pairs are stretched. A larger β_fast moves the
# start of the ramp to faster pairs; a smaller β_slow moves its end to slower ones. With β_fast = 32 and
# β_slow = 1 (the YaRN paper's defaults) the ramp spans several pairs instead of K2's single step.

# %% tags=["nbval-ignore-output"]
viz.widgets.yarn_explorer(k2)

# %% [markdown]
# ## K2-nano
#
# The miniature keeps YaRN ×32 from 4,096 but has 16 rotary features (8 pairs), so its cut falls elsewhere:

# %%
# NBVAL_CHECK_OUTPUT
print("nano (low, high):", rope.yarn_correction_range(nano),
      " ramp:", [round(g, 2) for g in rope.yarn_ramp(nano).tolist()])
print(f"nano softmax scale: {nano.softmax_scale:.7f} (= {nano.qk_head_dim}^-0.5 * m^2)")

# %% [markdown]
# ## More exercises
#
# ### Exercise 3 ★ · Predict, then run
#
# K2-Instruct-0905 serves 262,144 positions with YaRN factor 64 instead of 32. Does the larger factor change *which*
# pairs are stretched? What does it change? Predict, then compare `my_yarn` (or `rope.yarn_correction_range` and
# `softmax_scale`) for `k2.replace(rope_factor=64.0)` with K2's.

# %%
# your code here

# %% [markdown] tags=["hint"]
# **Hint 1 · the idea**
#
# Two different questions: which pairs are stretched (the ramp's range) and by how much (the factor s).
# Write down what each of them depends on.

# %% [markdown] tags=["hint"]
# **Hint 2 · the code**
#
# d(β) depends on R, the base, the original context L and β: is s among them? Compare
# `rope.yarn_correction_range` and `softmax_scale` of `k2.replace(rope_factor=64.0, max_position_embeddings=262_144)`
# with K2's.

# %% [markdown] tags=["solution"]
# The range depends only on β, the base and the original context (4,096), so the same pairs 20..31 are stretched;
# they are divided by 64 instead of 32, and m = 0.1·ln(64) + 1, hence the softmax scale, grows.

# %% tags=["solution"]
# Solution (click to show)
k2_0905 = k2.replace(rope_factor=64.0, max_position_embeddings=262_144)
print(f"factor 32: range {rope.yarn_correction_range(k2)}, softmax scale {k2.softmax_scale:.5f}")
print(f"factor 64: range {rope.yarn_correction_range(k2_0905)}, softmax scale {k2_0905.softmax_scale:.5f}")

# %% [markdown]
# ### Exercise 4 ★ · Change a knob
#
# Give K2 DeepSeek-V3's base, `k2.replace(rope_theta=10_000.0)`, keeping β = 1. Before you run it: do more or fewer
# pairs keep their frequency, and why?

# %%
# your code here

# %% [markdown] tags=["hint"]
# **Hint 1 · the idea**
#
# The kept pairs are those that turned often enough within the original 4,096 positions. What does a smaller
# base do to every pair's speed?

# %% [markdown] tags=["hint"]
# **Hint 2 · the code**
#
# `rope.yarn_correction_dim(1.0, R, 10_000.0, L)` is d(1) for the new base; `rope.yarn_ramp(k2.replace(rope_theta=
# 10_000.0))` is 0 for every kept pair.

# %% [markdown] tags=["solution"]
# Every pair spins faster with base 10,000, so more of them complete a turn within 4,096 positions: d(1) moves from
# 19.2 to 22.5, and pairs 0..22 keep their frequency.

# %% tags=["solution"]
# Solution (click to show)
base_10k = k2.replace(rope_theta=10_000.0)
print(f"d(1) = {rope.yarn_correction_dim(1.0, R, 10_000.0, L):.2f}, range {rope.yarn_correction_range(base_10k)}, "
      f"kept pairs: {int((rope.yarn_ramp(base_10k) == 0).sum())}")
