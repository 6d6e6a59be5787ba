import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# tf.compat.v1.layers needs the Keras 2 package (tf_keras) under Keras 3.
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
sys.path.insert(0, os.path.dirname(__file__))

# The usual first line of a ported TF1 script; test_v1_behavior.py runs
# suites in a process with this set (v1 TensorShape, reference variables,
# v1 control flow, no eager execution).
V1_BEHAVIOR = os.environ.get("PARALLAX_NG_TEST_V1_BEHAVIOR") == "1"
if V1_BEHAVIOR:
    import tensorflow as tf
    tf.compat.v1.disable_v2_behavior()
