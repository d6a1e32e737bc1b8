"""cllm.serve with a shorter GIL switch interval (first argument, seconds)."""
import runpy, sys
sys.setswitchinterval(float(sys.argv.pop(1)))
sys.argv[0] = "cllm.serve"
runpy.run_module("cllm.serve", run_name="__main__")
