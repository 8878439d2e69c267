"""The run: preflight, placement, the trainer group, the engine pool, the reward worker, the
driver loop and its stages, metrics. Submodules are imported explicitly; this package imports
nothing eagerly (`preflight` and `placement` import no torch or Ray)."""
