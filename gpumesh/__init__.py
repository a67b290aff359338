"""gpumesh's composition root: the `gpumesh` command and logging set-up."""

__version__ = "0.1.0"
