from renderfleet.cli import main

main()
