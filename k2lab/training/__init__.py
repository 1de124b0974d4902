"""Training a small K2 with K2's recipe: the corpus (the Python standard library and its test suite), MuonClip
with QK-Clip, aux-loss-free router-bias balancing and the WSD schedule. ``python -m k2lab.training --preset nano``
trains K2-nano."""
