"""Notebook-style: the LFW subset on a Spark cluster, features -> fit -> export -> predict.

    SPARK_MASTER=spark://127.0.0.1:7077 python examples/spark_lfw.py [IMAGE_FOLDER]

(without SPARK_MASTER: local[2]). Prints the accuracy of the exported model over the table.
"""

import os
import sys
import tempfile

from pyspark.sql import SparkSession
from pyspark.sql import functions as F

import kestrel
import kestrel.spark as ks

folder = sys.argv[1] if len(sys.argv) > 1 else os.path.expanduser("~/.cache/kestrel/datasets/lfw/imagefolder")
work = tempfile.mkdtemp(prefix="kestrel-example-")
spark = SparkSession.builder.master(os.environ.get("SPARK_MASTER", "local[2]")).getOrCreate()

# Cell 1: the images, labelled by their folder (Spark's binaryFile reader).
df = spark.read.format("binaryFile").option("recursiveFileLookup", "true").load(folder)
df = df.withColumn("label", F.element_at(F.split("path", "/"), -2))

# Cell 2: the frozen backbone's features, on the executors, also stored as Kestrel's feature
# cache (a directory every node sees: here one machine; on Databricks /dbfs/... or /Volumes/...).
cache = f"{work}/cache"
feats = ks.features(df, cache=cache).cache()
print("features:", feats.count(), "rows of", len(feats.first().features))

# Cell 3: training, one rank per task of a barrier stage; the backbone does not run again.
summary = ks.fit(df, out=f"{work}/run", num_workers=2, cache=cache, no_mlflow=True)
print("validation accuracy:", summary["val_accuracy"], "backbone runs:", summary["backbone_runs"])

# Cell 4: the artifact the devices run.
kestrel.export(f"{work}/run", out=f"{work}/artifact", no_mlflow=True)

# Cell 5: batch inference over the table with the exported artifact.
pred = ks.predict(df, f"{work}/artifact")
acc = pred.select(F.avg((F.col("prediction") == F.col("label")).cast("double"))).first()[0]
print(f"accuracy of the exported model over {pred.count()} images: {acc:.3f}")
