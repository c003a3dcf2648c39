"""`python -m kvconvert.cli ...` (scripts, accelerate and torchrun launches): kvconvert.commands.main."""

from kvconvert.commands.main import main

if __name__ == "__main__":
    main()
