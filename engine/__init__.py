"""The engine process's composition root: the loop (loop.py), the process entry (process.py), the
factory that builds scheduler, workers and model from a config (factory.py) and the memory plan
(memory_plan.py, admission.py, plan.py).

Nothing is imported here: the front end imports `engine.process` to spawn the engine, and that module
must stay free of torch until it runs in the child."""
