"""The expert cache: what is resident per layer and the one pure miss policy (`decide`)."""
