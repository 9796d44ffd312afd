"""Trainer function: LoRA training runs on a frozen base model (see function.py)."""


def new():
    """The Function instance (Knative Functions "instanced" template entry point)."""
    from functions.trainer.function import TrainerFunction

    return TrainerFunction()
