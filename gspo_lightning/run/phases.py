"""What the running step is doing, for the progress display: defined in
``gspo_lightning/rollout/phases.py`` (the engine's decode loop writes it, and rollout/ imports
nothing from run/); these names stay importable from here."""

from gspo_lightning.rollout.phases import PHASES, Phase, PhaseTracker

__all__ = ["PHASES", "Phase", "PhaseTracker"]
