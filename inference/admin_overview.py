"""The operator's overview (stub: being built)."""
from django.http import HttpResponse


def overview(request):
    return HttpResponse("not yet", status=501)
