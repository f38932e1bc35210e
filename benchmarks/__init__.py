"""harts' benchmarks, outside the package (``pip install harts`` ships none of them).

Run each from the repository root as a module, ``python -m benchmarks.<group>.<name> --help``:

* ``ops/``      one operator or kernel family on the shapes a real step gives it;
* ``modules/``  one layer or a whole model's forward and backward, against a reference;
* ``step/``     a training step's stages (compaction, call and step planning, operator counts,
                several GPUs, the engine and the server over it).

``_runner`` is what they share (parser, device, timing, the JSON writer). Results go to
``benchmarks/results/``, one dated file each with the command that produced it.
"""
