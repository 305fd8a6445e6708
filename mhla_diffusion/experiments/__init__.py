"""Small end-to-end experiments that check the paper's claims on real data at a size that runs
anywhere (see recipes/experiments/). Needs scikit-learn (`pip install -e ".[experiments]"`)."""
