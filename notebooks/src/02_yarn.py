# %% [markdown]
# # 02 · Positions: RoPE and YaRN
#
# Attention by itself does not know where tokens are. K2 tells it with **rotary position embeddings**
# ([RoPE](GLOSSARY.md#rope)):
# each query and key carries R = 64 *rotary features*, read as 32 pairs. At position p, pair i is rotated by the
# angle p·θ_i, with
#
# $$\theta_i = \text{base}^{-2i/R}, \qquad \text{base} = 50{,}000 .$$
#
# The dot product of a rotated query at position p and a rotated key at position q then depends only on p − q:
# relative position, for free. Pair 0 spins fast (one turn every 2π ≈ 6.3 positions); pair 31 spins very slowly.
# Its **wavelength**, the number of positions for one full turn, is λ_i = 2π/θ_i.
#
# This notebook is about numbers in K2's configuration; it loads no weights.

# %%
import math

from k2lab import K2Config, lab

from k2lab.model import rope

lab.setup_notebook()
k2 = K2Config.kimi_k2()
plain = k2.replace(rope_type=None)  # the same RoPE without YaRN
wavelength = 2 * math.pi / rope.inverse_frequencies(plain)  # [R/2] positions per turn

# %% [markdown]
# K2 was pretrained with a context of 4,096 tokens (`original_max_position_embeddings`). Pairs whose wavelength is
# shorter than that turned many times during pretraining; pairs with longer wavelengths never completed one turn,
# so the model never saw their angles beyond 4,096 positions:

# %%
# NBVAL_CHECK_OUTPUT
for i in (0, 1, 19, 20, 31):
    print(f"pair {i:>2}: wavelength {wavelength[i].item():>12,.1f} positions "
          f"({k2.original_max_position_embeddings / wavelength[i].item():8.2f} turns in 4,096)")

# %% [markdown]
# ## YaRN: stretch only what needs stretching
#
# To serve 131,072 positions (32 times more), [YaRN](GLOSSARY.md#yarn) (Peng et al., 2023) changes the frequencies
# by pair:
#
# * pairs that turn more than β_fast times within the original context keep their frequency (interpolating them
#   would blur the fine position information they carry);
# * pairs that turn fewer than β_slow times are divided by the factor s = 32, so 131,072 new positions cover the
#   same angles that 4,096 did;
# * a linear ramp γ_i joins the two:
#
# $$\theta'_i = \theta_i\left((1-\gamma_i) + \frac{\gamma_i}{s}\right), \qquad
#   \gamma_i = \operatorname{clamp}\left(\frac{i - \text{low}}{\text{high} - \text{low}}, 0, 1\right).$$
#
# The ramp's ends are the pairs that make β turns in the original context L:
# $d(\beta) = \frac{R \ln(L / 2\pi\beta)}{2 \ln \text{base}}$, low = ⌊d(β_fast)⌋, high = ⌈d(β_slow)⌉. K2 sets
# β_fast = β_slow = 1, so both ends come from one turn:

# %%
# NBVAL_CHECK_OUTPUT
L = k2.original_max_position_embeddings
d = rope.yarn_correction_dim(1.0, k2.qk_rope_head_dim, k2.rope_theta, L)  # beta = 1 turn in L
print(f"d(1) = {d:.3f}  ->  (low, high) = {rope.yarn_correction_range(k2)}")
ramp = rope.yarn_ramp(k2)  # [R/2]
print("ramp:", [round(g) for g in ramp.tolist()])
kept = [i for i, g in enumerate(ramp.tolist()) if g == 0]
print(f"pairs {kept[0]}..{kept[-1]} keep their frequency; "
      f"pairs {len(kept)}..{len(ramp) - 1} are divided by {k2.rope_factor:g}")

# %% [markdown]
# For K2 the "ramp" is a step: pairs 0..19 keep their frequency and pairs 20..31 are divided by 32. The figure
# shows the wavelengths before and after: the slow pairs' wavelengths grow 32-fold, past the new context.

# %% tags=["nbval-ignore-output"]
from k2lab import viz

viz.yarn_figure(rope.inverse_frequencies(plain), rope.inverse_frequencies(k2), ramp,
                k2.original_max_position_embeddings, k2.max_position_embeddings,
                title="Kimi K2: RoPE wavelengths before and after YaRN (s = 32)")

# %% [markdown]
# ## The temperature: mscale and the [softmax scale](GLOSSARY.md#softmax-scale)
#
# Stretching positions flattens attention a little, so YaRN sharpens it back with a temperature
# m = 0.1·ln(s) + 1. The release does this in two places that partly cancel:
#
# * cos and sin are multiplied by mscale(s, mscale) / mscale(s, mscale_all_dim); with both settings 1 this is
#   exactly 1;
# * the softmax scale, usually $1/\sqrt{d}$ with d = 128 + 64 = 192 query/key features, is multiplied by m²
#   (m once for the query and once for the key):
#
# $$\text{softmax scale} = 192^{-1/2} \cdot m^2 = 0.0721688 \times 1.3465736^2 = 0.1308608 .$$

# %%
# NBVAL_CHECK_OUTPUT
m = 0.1 * math.log(k2.rope_factor) + 1
print(f"m = {m:.7f} (config: {k2.yarn_mscale:.7f})")
print(f"cos/sin factor = {rope.cos_sin_scale(k2):.1f}")
print(f"softmax scale  = {k2.qk_head_dim ** -0.5:.7f} * {m:.7f}^2 = {k2.softmax_scale:.7f}")

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
nano = K2Config.nano()
print("nano (low, high):", rope.yarn_correction_range(nano),
      " ramp:", [round(g, 2) for g in rope.yarn_ramp(nano).tolist()])
print(f"nano softmax scale: {nano.softmax_scale:.7f} (= {nano.qk_head_dim}^-0.5 * m^2)")

# %% [markdown]
# ## Exercises
#
# **1. Predict, then run.** K2-Instruct-0905 serves 262,144 positions with YaRN factor 64 instead of 32. Does the
# larger factor change *which* pairs are stretched? What does it change? Predict, then compare
# `rope.yarn_correction_range` and `softmax_scale` of `k2.replace(rope_factor=64.0)` with K2's.
#
# **2. Change a knob.** Set `beta_fast=32.0` (the YaRN paper's default) in `k2.replace(...)` and print the ramp.
# Before you run it: which end of the ramp moves, and towards faster or slower pairs?

# %%
# your code here

# %% [markdown]
# **3. Write it yourself: the rotation.** Rotate each pair of features (x_i, x_{i+R/2}) of every row by the angle
# position × inv_freq[i]:
#
# $$\begin{pmatrix} x_i' \\ x_{i+R/2}' \end{pmatrix} =
#   \begin{pmatrix} \cos\phi & -\sin\phi \\ \sin\phi & \cos\phi \end{pmatrix}
#   \begin{pmatrix} x_i \\ x_{i+R/2} \end{pmatrix}, \qquad \phi = p\,\theta_i .$$
#
# (This is the "rotate-half" layout. The checkpoint stores each pair as neighbours (x_0, x_1), ...; k2lab
# de-interleaves them first, then rotates as here.) Then use your function to see the point of RoPE: the dot product
# of a rotated query at position p and a rotated key at position q depends only on p − q.

# %%
import torch

from k2lab.lab import exercises


def my_rotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """x [T, R], positions [T] (integers), inv_freq [R/2] -> [T, R]"""
    raise NotImplementedError


print(exercises.check_rotation(my_rotate))

# %% [markdown]
# ## Solutions
#
# **1.** The range depends only on β and the original context (4,096), so the same pairs 20..31 are stretched;
# they are divided by 64 instead of 32, and m, hence the softmax scale, grows.

# %% tags=["solution"]
k2_0905 = k2.replace(rope_factor=64.0, max_position_embeddings=262_144)
print(f"factor 32: range {rope.yarn_correction_range(k2)}, softmax scale {k2.softmax_scale:.5f}")
print(f"factor 64: range {rope.yarn_correction_range(k2_0905)}, softmax scale {k2_0905.softmax_scale:.5f}")

# %% [markdown]
# **2.** A larger β_fast asks the kept pairs to turn more often within 4,096 positions, so fewer pairs qualify: the
# start of the ramp moves to faster pairs (lower indices), and the ramp now spans several pairs.

# %% tags=["solution"]
print("beta_fast = 32:", rope.yarn_correction_range(k2.replace(beta_fast=32.0)),
      [round(g, 2) for g in rope.yarn_ramp(k2.replace(beta_fast=32.0)).tolist()])

# %% [markdown]
# **3.** Split the features into the two halves, rotate, concatenate; then two positions with the same distance
# give the same score:

# %% tags=["solution"]
def my_rotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    angles = positions[:, None].float() * inv_freq  # [T, R/2]
    a, b = x.chunk(2, dim=-1)  # the pairs' first and second features
    return torch.cat([a * angles.cos() - b * angles.sin(), a * angles.sin() + b * angles.cos()], dim=-1)


assert exercises.check_rotation(my_rotate)
print(exercises.check_rotation(my_rotate))
inv_freq = rope.inverse_frequencies(nano)
q, k = torch.randn(2, nano.qk_rope_head_dim, generator=torch.Generator().manual_seed(0)).chunk(2)
score = lambda p, s: (my_rotate(q, torch.tensor([p]), inv_freq) @ my_rotate(k, torch.tensor([s]), inv_freq).T).item()  # noqa: E731
print(f"score(10, 7) = {score(10, 7):.4f}, score(1010, 1007) = {score(1010, 1007):.4f}, "
      f"score(10, 3) = {score(10, 3):.4f}")
