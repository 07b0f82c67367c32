from ckptfx.cli import main

main()
