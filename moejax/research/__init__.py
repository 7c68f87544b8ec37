"""Research tools: the exact emulator, the router-logit simulator, the time model (hardware profiles are in moejax.offload.hardware), routing statistics and the quality study."""
