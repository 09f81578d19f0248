"""`kd.cluster_resolver`: where the processes of a multi-worker job are.

- `base`: `ClusterResolver`, the answers every resolver gives.
- `resolvers`: explicit addresses, `TF_CONFIG`, Keras' variables, and
  `resolve()`, which tries each resolver in order.
- `schedulers`: torchrun, JAX on Kubernetes, Ray Train, SLURM, submitit.
- `cluster_spec`: `ClusterSpec`, tf.distribute's job → addresses table.
- `tpu`: `TPUClusterResolver` (TPU detection; `ValueError` without one).

May import: `common`, `job`. Imports no framework.
"""

from keras_distribute.cluster_resolver.base import ClusterResolver  # noqa: F401
from keras_distribute.cluster_resolver.cluster_spec import ClusterSpec  # noqa: F401
from keras_distribute.cluster_resolver.resolvers import (
           KerasDistributionClusterResolver,  # noqa: F401
)
from keras_distribute.cluster_resolver.resolvers import SimpleClusterResolver  # noqa: F401
from keras_distribute.cluster_resolver.resolvers import TFConfigClusterResolver  # noqa: F401
from keras_distribute.cluster_resolver.resolvers import resolve  # noqa: F401
from keras_distribute.cluster_resolver.schedulers import JaxEnvClusterResolver  # noqa: F401
from keras_distribute.cluster_resolver.schedulers import RayTrainClusterResolver  # noqa: F401
from keras_distribute.cluster_resolver.schedulers import SlurmClusterResolver  # noqa: F401
from keras_distribute.cluster_resolver.schedulers import (
           SubmititLocalClusterResolver,  # noqa: F401
)
from keras_distribute.cluster_resolver.schedulers import (
           TorchElasticClusterResolver,  # noqa: F401
)
from keras_distribute.cluster_resolver.schedulers import expand_slurm_nodelist  # noqa: F401
from keras_distribute.cluster_resolver.schedulers import iter_slurm_nodelist  # noqa: F401
from keras_distribute.cluster_resolver.tpu import TPUClusterResolver  # noqa: F401

__all__ = ("ClusterResolver", "ClusterSpec", "JaxEnvClusterResolver",
           "KerasDistributionClusterResolver", "RayTrainClusterResolver",
           "SimpleClusterResolver", "SlurmClusterResolver",
           "SubmititLocalClusterResolver", "TFConfigClusterResolver",
           "TPUClusterResolver",
           "TorchElasticClusterResolver", "expand_slurm_nodelist",
           "iter_slurm_nodelist", "resolve")
