"""`python -m sgrec.radix.hrcs`, the command's old name, still runs `python -m sgrec.items.hrcs` (HRCS
placement moved to sgrec/items/ with the rest of BAT's item KV). Only a command alias: radix/ imports
nothing of items/, so importing this module is an error that names the new one."""

import runpy

if __name__ != "__main__":
    raise ImportError("sgrec.radix.hrcs moved to sgrec.items.hrcs (`python -m sgrec.radix.hrcs` still works)")
runpy.run_module("sgrec.items.hrcs", run_name="__main__", alter_sys=True)
