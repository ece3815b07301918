"""Engine lab: model directories and engine processes for the engine tests and benchmarks (needs the engine extra
inside the engine's own process only: these modules import neither torch nor vLLM at import time)."""
