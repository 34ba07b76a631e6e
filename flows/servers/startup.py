"""A posttrain program's start-up runs without garbage collection.

Start-up is imports (MLflow and its SQL store, Prefect, torch, transformers) and a plan: objects
that live as long as the process. Python's collector walks them again and again
while they are made: 0.4 s of a 1.9 s fully cached rerun, and 1.6 s of the 7.3 s that importing
torch, transformers, datasets and TRL took on a 2-core machine (5.7 s with collection off).

So posttrain's own programs (``posttrain run``, a training rank) pause collection as they start
(``pause``) and end start-up once (``end``): as the first stage this process runs starts, once the
libraries stages use are imported (before its inputs are resolved: flows/execution/execute.py), in a rank
before the stage function, or before the run waits on stages that run elsewhere.
Ending it freezes what exists (``gc.freeze``: never collected, never walked again, which also
makes every later full collection cheaper) and turns collection back on. Once only: a second
freeze would keep the first stage's garbage (a model, its optimizer) for good. What start-up
left as garbage, about 15 thousand objects (a few MB), is kept too. A process that did not
pause (a program that calls posttrain's functions, the tests) is left as it is.
"""

from __future__ import annotations

import gc

_paused = False
_ended = False


def pause() -> None:
    """Collection off until ``end``: called first thing by a posttrain program (once; never after ``end``)."""
    global _paused
    if gc.isenabled() and not _ended:
        gc.disable()
        _paused = True


def paused() -> bool:
    return _paused


def end(import_stage_libraries: bool = False) -> None:
    """Start-up is over (if it was paused): import what stages use first if asked, freeze, collect again."""
    global _paused, _ended
    if not _paused:
        return
    if import_stage_libraries:
        import_libraries()
    gc.freeze()
    gc.enable()
    _paused, _ended = False, True


def import_libraries() -> None:
    """What every stage kind imports before it works: torch and transformers' model and tokenizer
    classes (TRL, datasets and the rest come with the kinds that use them, collected as usual). The warm
    process imports these too (flows/servers/warm.py)."""
    import torch  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401
