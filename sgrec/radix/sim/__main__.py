"""`python -m sgrec.radix.sim`: see sgrec/radix/sim/simulator.py."""

from sgrec.radix.sim.simulator import main

main()
