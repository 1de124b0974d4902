"""``python -m k2lab.training --preset nano``: train K2-nano with K2's recipe (see ``train.main``)."""

from .train import main

main()
