from services.cli.app import app

app()
