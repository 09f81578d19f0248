"""`ClusterSpec`: the jobs of a cluster, as `tf.train.ClusterSpec`."""

from typing import Dict
from typing import List


class ClusterSpec(dict):
    """The jobs of a cluster, `{job name: [addresses]}`, with the methods of
    `tf.train.ClusterSpec` (the multi-worker tutorials' `_is_chief` calls
    `cluster_spec.as_dict()`). Returned by `resolver.cluster_spec()`.

    Example:

    >>> spec = ClusterSpec({"worker": ["a:1", "b:1"]})
    >>> spec.num_tasks("worker"), "chief" in spec.as_dict()
    (2, False)
    """

    @property
    def jobs(self) -> List[str]:
        """The job names."""
        return list(self)

    def as_dict(self) -> Dict[str, List[str]]:
        """A plain dict copy, as `tf.train.ClusterSpec.as_dict()`."""
        return {job: list(tasks) for job, tasks in self.items()}

    def num_tasks(self, job_name: str) -> int:
        """The number of tasks of `job_name`.

        Raises:
            ValueError: if there is no such job.
        """
        return len(self.job_tasks(job_name))

    def job_tasks(self, job_name: str) -> List[str]:
        """The addresses of `job_name`'s tasks.

        Raises:
            ValueError: if there is no such job.
        """
        if job_name not in self:
            raise ValueError(
                f"No job {job_name!r} in this cluster. Its jobs: {self.jobs}.")
        return list(self[job_name])

    def task_address(self, job_name: str, task_index: int) -> str:
        """The address of task `task_index` of `job_name`.

        Raises:
            ValueError: if there is no such job or task.
        """
        tasks = self.job_tasks(job_name)
        if not 0 <= task_index < len(tasks):
            raise ValueError(
                f"Job {job_name!r} has tasks 0..{len(tasks) - 1}. Received: "
                f"task_index={task_index}.")
        return tasks[task_index]
