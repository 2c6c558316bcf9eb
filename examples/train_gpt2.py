"""The former name of examples/train.py, kept so that commands written for it keep working:
the same script (GPT-2 and Llama-family models over any mesh), under this name in its
messages."""
from train import main      # this script's directory is the first on the path

if __name__ == "__main__":
    main()
