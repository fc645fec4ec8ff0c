"""Engine adapters (vLLM, SGLang); nothing in kvtiers imports them."""
