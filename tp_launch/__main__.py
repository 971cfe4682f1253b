from tp_launch.cli import main

main()
