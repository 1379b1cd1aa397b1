"""The machinery beside the book: what the programs need around the papers, one module per job.

The five chapters (norms.py, model.py, data.py, decode.py, train.py) hold the papers' equations
and algorithms; a reader of the book never needs to open this package. The commands stay the
chapters': ``python train.py``, ``python decode.py``, ``python data.py`` and ``python norms.py
--benchmark`` hand their command lines over to the modules here.

    fileio      the project's files in and out: DataError, reading lines exactly, atomic writes
    rundir      the run directory, checkpoints, --resume, signals, start-or-resume
    logbook     the run's log: the console, train.log, metrics.jsonl, TensorBoard
    speed       the timing harness, FLOPs and MFU, --benchmark and --profile
    processes   this process (threads, seeds, device) and several (torchrun, DDP, --compile)
    toy_corpus  the built-in synthetic corpus
    corpora     the papers' corpora (python data.py prepare NAME), and a corpus into a run
    arguments   train.py's flags and the value types both programs share
    presets     the papers' rows as presets (--preset NAME), --config
    train_cli   python train.py: main(), the checks of the flags, --resume's flags
    decode_cli  python decode.py: its flags, modes and file checks
    plots       --plot, attention heatmaps, PNG figures

Imports run one way: fileio lowest; the chapters import the modules below them; arguments,
presets, train_cli and decode_cli sit on top and import the chapters.
"""
