"""The toolkit's layers, top to bottom: a module imports only from its own layer or one below it, and no import
circle exists (tests/test_import_layers.py walks every import, in-function ones included, and holds the code to
this table). Within a layer, a package imports only from itself or from a package listed after it on the line.

    cli            toolkit/cli.py, __main__.py        the command line: parses, dispatches, one line per mistake
    compare        toolkit/compare/                   A/B experiments: arms, runner, verdict, report
    launch         toolkit/launch/                    torch.distributed.run, one rank's entry, how ranks ended
    train          toolkit/train/                     the one loop, its checks, evaluation, run.json
    plan           toolkit/plan/                      `toolkit plan`: memory per rank before a run
    strategies     toolkit/strategies/                the parallel strategies (zero/, pipeline/ inside)
    memory         toolkit/memory/, toolkit/cost/     model-state bytes from shapes, traced activations; hardware
                                                      profiles, collectives and the step-time model
    checkpoint     toolkit/checkpoint/                one DCP layout; where a run's starting weights come from
    model          toolkit/model/                     build/load, blocks, LoRA, export, cuts, tied names
    data           toolkit/data/                      files -> datasets -> tokenized splits, the loss
    observe        toolkit/observe/                   metrics, trackers, profiling, collective counter, routing
    process        toolkit/process/                   process group and device, signals, faults, console
    config         toolkit/config/                    typed recipes from YAML and overrides
    base           toolkit/errors.py, atomic.py       user errors, whole-file writes
"""

# top to bottom; each entry: the layer's name and the modules or packages (under toolkit.) it holds
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("cli", ("cli", "__main__")),
    ("compare", ("compare",)),
    ("launch", ("launch",)),
    ("train", ("train",)),
    ("plan", ("plan",)),
    ("strategies", ("strategies",)),
    ("memory", ("memory", "cost")),
    ("checkpoint", ("checkpoint",)),
    ("model", ("model",)),
    ("data", ("data",)),
    ("observe", ("observe",)),
    ("process", ("process",)),
    ("config", ("config",)),
    ("base", ("errors", "atomic", "layers", "")),  # "": the package's own __init__
)
