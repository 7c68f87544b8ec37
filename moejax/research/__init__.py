"""Research tools: the exact emulator, the router-logit simulator, the time model and hardware shapes, routing statistics and the quality study."""
