#!/usr/bin/env bash
# The lead's part of the sixteenth session's calls (lead12_call.sh with S=16, part "lead"): lead15.sh's phases on
# the merged tree (warm: compiles and graph == eager on a 4 x 32 model; measure: issue 15's table on $M48;
# final: worker starts, GPU tests (GPU_TESTS), graph == eager, b1/b8 with 3 repeats).
exec bash tools/device/lead15.sh
