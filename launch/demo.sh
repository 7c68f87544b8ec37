#!/usr/bin/env bash
# Install (venv + pip) and run the main job on the shipped demo model (ckpts/demo).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
exec python -m launch.generate --model_dir=ckpts/demo --policy=quality --cache_fraction=0.25 --link=scaled "$@"
