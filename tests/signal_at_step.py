"""Runs a trainer (a GPT-2 trainer, or the translator) with a signal delivered at a known point of its run,
so that the tests of SIGINT and SIGTERM do not race a fast run to its end:

    python tests/signal_at_step.py STEP SIGNALS SCRIPT [ARGS...]

sends the process itself each of SIGNALS (comma-separated, e.g. SIGINT or SIGTERM,SIGTERM) just after the
trainer has logged step STEP's train loss, that is between two step boundaries, as a user's Ctrl-C lands.
The trainer runs as it does from the shell: its own main() and signal handling; only its log_event, which
writes the step's event, is wrapped."""
import importlib
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    at_step, names, script, argv = int(sys.argv[1]), sys.argv[2].split(","), sys.argv[3], sys.argv[4:]
    trainer = importlib.import_module(os.path.basename(script).removesuffix(".py"))
    log_event = trainer.log_event

    def log_then_signal(*args, **event):
        log_event(*args, **event)
        if event.get("step") == at_step and "train_loss" in event:
            for name in names:
                os.kill(os.getpid(), getattr(signal, name))
    trainer.log_event = log_then_signal
    sys.exit(trainer.main(argv))


if __name__ == "__main__":
    main()
