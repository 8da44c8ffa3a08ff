"""The launcher half of the verl hook: make verl's legacy task runner build a probe trainer.

verl's legacy trainer (``trainer.use_v1=False``) is built by ``TaskRunner.run``
(``verl/trainer/main_ppo_v0.py``, 0.9.1) as ``trainer = RayPPOTrainer(...)``: a lookup of the
global name ``RayPPOTrainer`` in the globals of ``run``, inside a Ray actor. Ray ships the actor
class with cloudpickle when ``main_ppo.run_ppo`` creates the actor, and pickles ``TaskRunner`` by
*value* (the module attribute ``TaskRunner`` is Ray's actor handle, not the class, so the class
cannot be found by name): ``run`` arrives in the actor with its own copy of the globals it
names, taken in the launching process at that moment. Assigning ``main_ppo_v0.RayPPOTrainer``
inside the actor (in a ``run`` override) therefore changes a module that copy never reads, and
verl trains its own ``RayPPOTrainer``: nothing is written, nothing is said. Assigning it in the
launching process before ``main_ppo.main()`` is what the copy captures.

``wire_verl_legacy(trainer_cls)`` does that, and makes it hold however Ray pickles the class:

- in the launching process it sets the name in the globals of the ``run`` that builds the
  trainer (``main_ppo_v0``'s own namespace there), so the by-value copy carries ``trainer_cls``;
- it puts a checked subclass of the task runner in ``main_ppo_v0.TaskRunner`` (the name
  ``main_ppo.main`` imports): in the actor, its ``run`` sets the name again in the globals that
  ``run`` really reads there (the copy, or the module itself were the class pickled by
  reference), counts the trainers built, and, should the run end without building
  ``trainer_cls`` (a task runner whose ``run`` builds its trainer elsewhere), says so in one
  warning line: a run that trained without a probe log does not pass in silence.

It refuses, with one line (``ProbeError``), what cannot work: a class that is not a
``RayPPOTrainer``, a call from inside a Ray actor (the task runner is already shipped: too
late), a verl whose task runner is not a Ray actor class or builds no ``RayPPOTrainer`` by name.
The V1 trainer (``trainer.use_v1=True``) is untouched: ``main_ppo.main`` runs ``TaskRunnerV1``
then, and the docs' recipe wraps its trainer class through ``TRAINER_REGISTRY``.

verl and Ray are imported when the function is called, never by ``import mismatch_probe``.
"""

from __future__ import annotations

import warnings
from typing import Any

from mismatch_probe.errors import ProbeError

TRAINER_NAME = "RayPPOTrainer"  # the global name TaskRunner.run builds its trainer by
CHECKED = "__mismatch_probe_trainer__"  # marks a task runner this module already wrapped


def wire_verl_legacy(trainer_cls: type) -> None:
    """Make ``main_ppo.main()`` (``trainer.use_v1=False``) build ``trainer_cls``, a subclass of
    verl's ``RayPPOTrainer``. Call it in the ``__main__`` block of the launch script, before
    ``main_ppo.main()``.

    Raises:
        ProbeError: ``trainer_cls`` is not a ``RayPPOTrainer``, the call runs inside a Ray
            actor, or verl's ``TaskRunner`` is not the one this wiring knows (verl 0.9.1).
    """
    try:
        import ray
        from verl.trainer import main_ppo_v0
        from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    except ImportError as err:
        raise ProbeError(f"wire_verl_legacy: verl's legacy trainer does not import: {err}") from err
    if not (isinstance(trainer_cls, type) and issubclass(trainer_cls, RayPPOTrainer)):
        raise ProbeError(f"wire_verl_legacy: {trainer_cls!r} is not a subclass of RayPPOTrainer")
    if ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None:
        raise ProbeError(
            "wire_verl_legacy runs inside a Ray actor (verl's task runner?): the task runner is "
            "already shipped; call it in the launch script's __main__ block, before "
            "main_ppo.main()"
        )
    v0: Any = main_ppo_v0  # its TaskRunner name is rebound below
    runner = v0.TaskRunner
    base = actor_class(runner)
    if CHECKED in vars(base):  # wired before: wrap the task runner under it, not this one
        base = base.__mro__[1]
    owner = trainer_builder(base)
    owner.run.__globals__[TRAINER_NAME] = trainer_cls  # here: main_ppo_v0's namespace
    options = dict(getattr(runner, "_default_options", None) or {})
    checked = checked_runner(base, owner, trainer_cls)
    v0.TaskRunner = ray.remote(**options)(checked) if options else ray.remote(checked)


def actor_class(runner: Any) -> type:
    """The class under a Ray ``@ray.remote`` actor class (``ActorClass``).

    Raises:
        ProbeError: ``runner`` is not a Ray actor class.
    """
    try:
        return runner.__ray_metadata__.modified_class.__ray_actor_class__  # type: ignore[no-any-return]
    except AttributeError:
        raise ProbeError(
            f"wire_verl_legacy: verl's main_ppo_v0.TaskRunner is {runner!r}, not a Ray actor class"
        ) from None


def trainer_builder(base: type) -> Any:
    """The class of ``base``'s MRO whose ``run`` builds the trainer by the global name
    ``RayPPOTrainer`` (verl's ``TaskRunner``, or a subclass that builds its own).

    Raises:
        ProbeError: no ``run`` of the MRO names ``RayPPOTrainer``.
    """
    for cls in base.__mro__:
        code = getattr(vars(cls).get("run"), "__code__", None)
        if code is not None and TRAINER_NAME in code.co_names:
            return cls
    raise ProbeError(
        f"wire_verl_legacy: {base.__qualname__}.run builds no {TRAINER_NAME} by name; this "
        "wiring is checked against verl 0.9.1's main_ppo_v0.TaskRunner"
    )


def checked_runner(base: type, owner: Any, trainer_cls: type) -> type:
    """A subclass of the task runner ``base`` whose ``run`` makes ``owner.run`` build
    ``trainer_cls`` in the actor and warns when the run ends without building one. Defined in
    a function, so Ray pickles it by value, with ``base``, ``owner`` and ``trainer_cls``."""
    label = f"{trainer_cls.__module__}.{trainer_cls.__qualname__}"

    class Checked(base):  # type: ignore[misc, valid-type]
        def run(self, config: Any) -> Any:
            names = owner.run.__globals__  # the globals run reads here: Ray's copy, or the module
            before = names.get(TRAINER_NAME)
            built: list[Any] = []

            def build(*args: Any, **kwargs: Any) -> Any:
                trainer = trainer_cls(*args, **kwargs)
                built.append(trainer)
                return trainer

            names[TRAINER_NAME] = build
            try:
                result = super().run(config)
            finally:
                names[TRAINER_NAME] = before
            if not built:
                warnings.warn(never_built(label, base), RuntimeWarning, stacklevel=1)
            return result

    # verl's names, for Ray's logs; the class still pickles by value (that name is Ray's handle)
    Checked.__name__, Checked.__qualname__ = base.__name__, base.__qualname__
    Checked.__module__ = base.__module__
    setattr(Checked, CHECKED, label)
    return Checked


def never_built(label: str, runner: type) -> str:
    """The warning of a legacy run that ended without building the probe trainer."""
    return (
        f"mismatch_probe: verl's task runner {runner.__qualname__} finished without building "
        f"{label}: no probe log was written (wire_verl_legacy wires verl 0.9.1's TaskRunner)"
    )
